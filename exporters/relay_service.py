"""The relay's HTTP front (Starlette, served by uvicorn), the healer's heartbeat path and nothing else:

    POST /v1/heartbeats     one node's batch (the same body, token and answers as the healer's)   (token; over
                            the run's TLS: the node's host certificate, 403 for another node's batch)
    GET  /healthz           200 while the last post to the healer went through, 503 (and why) otherwise
    GET  /metrics           the relay's own counters (batches in, refused, forwarded, failures, post time)

Refusals are JSON {"error": ..., "field": ...}: 401 without the token, 413 past the body limit, 400 naming the
field of a batch the healer would refuse, 507 when the relay holds max_nodes nodes already (the sender's
forwarder then keeps the batch for the next try, which may go to the healer).
"""

from __future__ import annotations

import ssl

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from exporters.relay import HeartbeatRelay, WrongNode
from ground.tls import peer_of
from wire.telemetry import SchemaError

MAX_BATCH_BODY = 1 << 20  # the healer's own limit for one node's batch


def create_relay_app(relay: HeartbeatRelay, max_body: int = MAX_BATCH_BODY) -> Starlette:
    def refusal(status: int, message: str, field: str | None = None) -> Response:
        return JSONResponse({"error": message, "field": field}, status_code=status)

    async def heartbeats(request: Request) -> Response:
        sender = None
        if request.url.scheme == "https":
            # NOTE: over TLS the host's certificate is the credential, as at the healer: every host holds the token.
            peer = peer_of(request.scope)
            if peer is None or peer.role != "host":
                return refusal(403, f"over TLS only a host's certificate from the run's authority may send this, "
                                    f"not {peer or 'no certificate'}")
            sender = peer.name
        elif not relay.authorized(request.headers.get("authorization", "")):
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
            taken = relay.take(body, sender)
        except SchemaError as exc:
            return refusal(400, exc.reason, exc.field or "body")
        except WrongNode as exc:
            return refusal(403, str(exc), "node")
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


def serve(relay: HeartbeatRelay, listen: str, tls: ssl.SSLContext | None = None) -> None:
    """Run the relay until SIGINT/SIGTERM (uvicorn's handlers), forwarding all the while; over `tls` (the relay's
    server context, hosts' certificates required) when given."""
    import uvicorn

    from ground.http_serving import guarded_h11, listening_socket, tls_config

    sock = listening_socket(listen)
    relay.start()
    try:
        # NOTE: bounded as the healer is: a node group's sidecars hold one connection each (ground/http_serving.py)
        uvicorn.Server(uvicorn.Config(create_relay_app(relay), access_log=False,
                                      log_config=None, timeout_graceful_shutdown=5, limit_concurrency=1024,
                                      http=guarded_h11(per_peer=64),
                                      **(tls_config(tls) if tls is not None else {}))).run(sockets=[sock])
    finally:
        relay.stop()
