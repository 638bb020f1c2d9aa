"""The relay's HTTP front (Starlette, served by uvicorn), the healer's heartbeat path and nothing else:

    POST /v1/heartbeats     one node's batch (the same body, token and answers as the healer's)   (token)
    GET  /healthz           200 while the last post to the healer went through, 503 (and why) otherwise
    GET  /metrics           the relay's own counters (batches in, refused, forwarded, failures, post time)

Refusals are JSON {"error": ..., "field": ...}: 401 without the token, 413 past the body limit, 400 naming the
field of a batch the healer would refuse, 507 when the relay holds max_nodes nodes already (the sender's
forwarder then keeps the batch for the next try, which may go to the healer).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from exporters.relay import HeartbeatRelay
from wire.telemetry import SchemaError

MAX_BATCH_BODY = 1 << 20  # the healer's own limit for one node's batch


def create_relay_app(relay: HeartbeatRelay, max_body: int = MAX_BATCH_BODY) -> Starlette:
    def refusal(status: int, message: str, field: str | None = None) -> Response:
        return JSONResponse({"error": message, "field": field}, status_code=status)

    async def heartbeats(request: Request) -> Response:
        if not relay.authorized(request.headers.get("authorization", "")):
            return refusal(401, "missing or wrong bearer token (Authorization: Bearer ...)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                return refusal(413, f"body larger than {max_body} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        if not body.strip():
            return refusal(400, "empty body", "body")
        try:
            taken = relay.take(body)
        except SchemaError as exc:
            return refusal(400, exc.reason, exc.field or "body")
        except OverflowError as exc:
            return refusal(507, str(exc))
        return JSONResponse({"accepted": taken}, status_code=202)

    async def healthz(request: Request) -> Response:
        if relay.failures:
            return refusal(503, f"the last {relay.failures} post(s) to the healer at {relay.url} failed")
        return JSONResponse({"relay": relay.name, "nodes": relay.nodes})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(relay.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/v1/heartbeats", heartbeats, methods=["POST"]),
                             Route("/healthz", healthz, methods=["GET"]),
                             Route("/metrics", metrics, methods=["GET"])])


def serve(relay: HeartbeatRelay, listen: str) -> None:
    """Run the relay until SIGINT/SIGTERM (uvicorn's handlers), forwarding all the while."""
    import uvicorn

    from ground.http_serving import guarded_h11

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"listen must be HOST:PORT, got {listen!r}")
    relay.start()
    try:
        # NOTE: bounded as the healer is: a node group's sidecars hold one connection each (ground/http_serving.py)
        uvicorn.Server(uvicorn.Config(create_relay_app(relay), host=host, port=int(port), access_log=False,
                                      log_config=None, timeout_graceful_shutdown=5, limit_concurrency=1024,
                                      http=guarded_h11(per_peer=64))).run()
    finally:
        relay.stop()
