"""The node agent's HTTP API (Starlette under uvicorn, on a thread of the agent).

    POST /v1/orders          an order (wire/orders.py)                           (token)  202 {state}
    GET  /v1/orders/{id}     its state: accepted, running, done (result) or failed (error)   (token)
    GET  /v1/state           the host's part of the current attempt               (token)
    GET  /healthz

Every order needs the job's token (constant-time comparison); an order whose id is known returns the first one's
state (a retried POST never starts a second attempt), and an id reused for another order is a 409, as is an order
of a healer epoch below the highest this agent has taken ("stale epoch N < M", field "epoch"). Bodies are
bounded; a malformed one is a 400 naming the field. An agent with TLS files (`NodeAgent.Config.tls_dir`) serves over
mutual TLS and takes orders only from a peer whose certificate names the run's healer: a host's own certificate,
which every host holds to report, cannot order (a 403).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ground.secretfile import bearer_matches
from ground.tls import TlsFiles, peer_of
from healer.agent.order_book import Conflict
from wire.orders import decode_order

if TYPE_CHECKING:
    from healer.agent.node import NodeAgent

MAX_BODY = 64 * 1024


def create_app(agent: NodeAgent) -> Starlette:
    def authorized(request: Request) -> bool:
        return bearer_matches(request.headers.get("authorization"), agent.cfg.token)

    def from_healer(request: Request) -> bool:
        """Over TLS, only the run's healer may order or ask (the token alone is held by every host)."""
        if agent.cfg.tls_dir is None:
            return True
        peer = peer_of(request.scope)
        return peer is not None and peer.role == "healer"

    def refuse(status: int, message: str, field: str | None = None) -> JSONResponse:
        return JSONResponse({"error": message, "field": field}, status_code=status)

    async def post_order(request: Request) -> Response:
        if not authorized(request):
            return refuse(401, "missing or wrong bearer token")
        if not from_healer(request):
            return refuse(403, "only the run's healer may order this agent (its certificate)")
        body = await request.body()
        if len(body) > MAX_BODY:
            return refuse(413, f"body larger than {MAX_BODY} bytes")
        try:
            order = decode_order(body)
        except msgspec.ValidationError as exc:
            return refuse(400, str(exc), _field(str(exc)))
        except msgspec.DecodeError as exc:
            return refuse(400, f"not a JSON order: {exc}", "body")
        except RecursionError:  # NOTE: msgspec skips an unknown field's value recursively: 64 KiB of '[' is too deep
            return refuse(400, "not a JSON order: nested too deeply", "body")
        try:
            state, _ = agent.submit(order)
        except Conflict as exc:
            return refuse(409, str(exc), exc.field)  # the id reused, or a stale epoch (an older healer)
        return JSONResponse(msgspec.to_builtins(state), status_code=202)

    async def get_order(request: Request) -> Response:
        if not authorized(request):
            return refuse(401, "missing or wrong bearer token")
        if not from_healer(request):
            return refuse(403, "only the run's healer may order this agent (its certificate)")
        state = agent.orders.get(request.path_params["id"])
        if state is None:
            return refuse(404, "no such order", "id")
        return JSONResponse(msgspec.to_builtins(state))

    async def get_state(request: Request) -> Response:
        if not authorized(request):
            return refuse(401, "missing or wrong bearer token")
        if not from_healer(request):
            return refuse(403, "only the run's healer may order this agent (its certificate)")
        return JSONResponse(agent.state())

    async def healthz(request: Request) -> Response:
        health = agent.health()
        return JSONResponse(health, status_code=200 if health["status"] == "ok" else 503)

    async def on_http(request: Request, exc: Exception) -> Response:
        """No such route or method: JSON like every other refusal (Starlette's own answer is plain text)."""
        assert isinstance(exc, HTTPException)
        return JSONResponse({"error": str(exc.detail), "field": None}, status_code=exc.status_code,
                            headers=exc.headers)  # a 405's Allow

    # NOTE: `{id:path}`: an order id may hold '/' (wire/orders.py OrderId), and an order taken must be found again.
    return Starlette(routes=[
        Route("/v1/orders", post_order, methods=["POST"]),
        Route("/v1/orders/{id:path}", get_order, methods=["GET"]),
        Route("/v1/state", get_state, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ], exception_handlers={HTTPException: on_http})


def _field(message: str) -> str | None:
    """msgspec says `... - at `$.field``: the field's path, for the 400."""
    at = message.rpartition("at `$")[2].rstrip("`")
    return at.lstrip(".") or None if "at `$" in message else None


def serve(agent: NodeAgent, listen: str) -> tuple[Any, int]:
    """uvicorn on a daemon thread; (server, bound port)."""
    import uvicorn

    from ground.http_serving import guarded_h11, listening_socket, tls_config

    sock = listening_socket(listen)
    tls = {} if agent.cfg.tls_dir is None else tls_config(TlsFiles(agent.cfg.tls_dir).server(require_peer=True))
    config = uvicorn.Config(create_app(agent), access_log=False, log_config=None, limit_concurrency=64,
                            http=guarded_h11(per_peer=16), timeout_graceful_shutdown=2, **tls)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="megaheal-agent-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.01)
    if not server.started:
        raise RuntimeError(f"the agent's API did not start on {listen}")
    return server, int(sock.getsockname()[1])
