"""The healer's one HTTP API (Starlette, served by uvicorn), for both front doors: the service (`megaheal healer`)
serves it on its address, and `megaheal run` serves it to its node agents (healer/runner/reports.py).

    POST /v1/heartbeats                  heartbeat batches from the sidecars         (token, or over TLS a host's cert)
    POST /v1/heartbeats/relayed          a relay's batch of its nodes' batches       (token, or over TLS a relay's)
    POST /v1/alertmanager                Alertmanager webhook, payload version 4     (token)
    GET  /v1/incidents[?state=&limit=&offset=]   GET /v1/incidents/{id} (with every transition)
    POST /v1/incidents/{id}/ack | /resolve   {"by": "...", "note": "..."} optional   (token)
    GET  /healthz  /readyz  /metrics

Served over mutual TLS (`megaheal run`: the run's authority, ground/tls.py), a heartbeat batch is taken on the
certificate it came with, not the token: a host's, for its own node only (403 for another's), and a relay's for
relayed batches. The token alone cannot report there: every host holds it.

Every refusal is JSON {"error": ..., "field": ...}: 401 without the bearer token, 413 over the body limit,
400 naming the field for malformed JSON, a wrong schema or a bad path or query parameter (healer.service.requests),
404/409 for a missing incident or an illegal transition, 503 while the database is unavailable (why: to
authenticated callers only). Bad input never reaches a 500.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ground.secretfile import bearer_matches
from ground.tls import peer_of
from healer.decide.states import IncidentState
from healer.engine.engine import Healer
from healer.errors import BadRequest, DatabaseError, IllegalTransition, NotFound, WrongSender
from healer.incidents.metrics import HealerMetrics
from healer.observe.heartbeats import HeartbeatTable
from healer.service.detection_first import DetectionFirst
from healer.service.health import UNAVAILABLE, Readiness
from healer.service.requests import Refused, decode_json, incident_query, not_empty, parse_int, person_fields, read_body

log = logging.getLogger(__name__)
Handler = Callable[[Request], Awaitable[Response]]


# NOTE: a relay's batch holds up to MAX_NODES_PER_RELAY nodes (by column ~1.5 KB a node of 8 ranks; ~6 KB in a
# schema-1 batch, each node's batch whole).
MAX_RELAY_BODY = 32 << 20


def create_app(healer: Healer, readiness: Readiness, token: str, max_body: int = 1 << 20,
               max_relay_body: int = MAX_RELAY_BODY, detection_first: DetectionFirst | None = None) -> Starlette:
    """`detection_first`: the gate heartbeats wait at while a detection cycle reads (None: they never wait)."""
    authorized, authorize = _token_check(token)

    async def alertmanager(request: Request) -> Response:
        authorize(request)
        body = decode_json(await read_body(request, max_body))
        ready_or_503(request)
        return JSONResponse(await run_in_threadpool(healer.handle_alertmanager, body))

    async def list_incidents(request: Request) -> Response:
        states, limit, offset = incident_query(request.query_params)
        ready_or_503(request)
        found = await run_in_threadpool(healer.store.list_incidents, states, limit, offset)
        return JSONResponse({"incidents": found})

    async def get_incident(request: Request) -> Response:
        incident_id = parse_int(request.path_params["id"], "id", 1, 2**62)
        ready_or_503(request)
        return JSONResponse(await run_in_threadpool(healer.store.get, incident_id))

    def person_action(new: IncidentState) -> Handler:
        async def act(request: Request) -> Response:
            authorize(request)
            incident_id = parse_int(request.path_params["id"], "id", 1, 2**62)
            raw = await read_body(request, max_body)
            by, note = person_fields(decode_json(raw) if raw.strip() else {})
            ready_or_503(request)
            return JSONResponse(await run_in_threadpool(healer.person_action, incident_id, new, by, note))
        return act

    def ready_or_503(request: Request) -> None:
        if not readiness.ready:
            raise Refused(503, "database unavailable: " + (readiness.reason if authorized(request) else UNAVAILABLE))

    async def readyz(request: Request) -> Response:
        body = readiness.report(detail=authorized(request))
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    async def metrics(request: Request) -> Response:
        data = await run_in_threadpool(generate_latest, healer.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    routes = [
        *_ingest_routes(healer, authorize, max_body, max_relay_body, detection_first),
        Route("/v1/alertmanager", alertmanager, methods=["POST"]),
        Route("/v1/incidents", list_incidents, methods=["GET"]),
        Route("/v1/incidents/{id}", get_incident, methods=["GET"]),
        Route("/v1/incidents/{id}/ack", person_action(IncidentState.ACKNOWLEDGED), methods=["POST"]),
        Route("/v1/incidents/{id}/resolve", person_action(IncidentState.RESOLVED), methods=["POST"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers=_handlers(healer.metrics, authorized))
    return app


class Ingest(Protocol):
    """What takes heartbeats: the engine (healer/engine/engine.py), or a table alone (`TableIngest`)."""

    def ingest_heartbeats(self, body: bytes, sender: str | None = None) -> int: ...

    def ingest_relayed(self, body: bytes) -> tuple[int, int]: ...


@dataclass(frozen=True, slots=True)
class TableIngest:
    """Heartbeats into a table with no healer around it: an agent's or a relay's tests, which need only the healer's
    endpoint (the same routes, checks and answers as the healer's)."""

    table: HeartbeatTable

    def ingest_heartbeats(self, body: bytes, sender: str | None = None) -> int:
        return self.table.ingest(body, sender)

    def ingest_relayed(self, body: bytes) -> tuple[int, int]:
        return self.table.ingest_relayed(body)


def ingest_app(ingest: Ingest, token: str, metrics: HealerMetrics | None = None, max_body: int = 4 << 20) -> Starlette:
    """Only the routes that take heartbeats (and /healthz), for `ingest`."""
    authorized, authorize = _token_check(token)
    return Starlette(routes=_ingest_routes(ingest, authorize, max_body, MAX_RELAY_BODY, None),
                     exception_handlers=_handlers(metrics or HealerMetrics(), authorized))


def _ingest_routes(ingest: Ingest, authorize: Callable[[Request], None], max_body: int, max_relay_body: int,
                   detection_first: DetectionFirst | None) -> list[Route]:
    def sender(request: Request, role: str) -> str | None:
        """Who may report: over TLS the peer's certificate of `role` (its name), else the token (None)."""
        if request.url.scheme != "https":
            authorize(request)
            return None
        peer = peer_of(request.scope)
        if peer is None or peer.role != role:
            raise Refused(403, f"over TLS only a {role}'s certificate from the run's authority may send this, "
                               f"not {peer or 'no certificate'}")
        return peer.name

    async def heartbeats(request: Request) -> Response:
        host = sender(request, "host")
        # NOTE: the raw bytes: the heartbeat table decodes them straight into the typed batch (wire/telemetry.py).
        body = not_empty(await read_body(request, max_body))
        if detection_first is not None:
            await detection_first.wait()
        # NOTE: in memory only and cheap: run on the event loop, no thread hop per batch (1,536 batches/s at scale).
        taken = ingest.ingest_heartbeats(body, host)
        return JSONResponse({"accepted": taken}, status_code=202)

    async def relayed(request: Request) -> Response:
        sender(request, "relay")
        body = not_empty(await read_body(request, max_relay_body))
        if detection_first is not None:
            await detection_first.wait()
        nodes, taken = ingest.ingest_relayed(body)
        return JSONResponse({"nodes": nodes, "accepted": taken}, status_code=202)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return [Route("/v1/heartbeats", heartbeats, methods=["POST"]),
            Route("/v1/heartbeats/relayed", relayed, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"])]


def _token_check(token: str) -> tuple[Callable[[Request], bool], Callable[[Request], None]]:
    def authorized(request: Request) -> bool:
        return bearer_matches(request.headers.get("authorization"), token)

    def authorize(request: Request) -> None:
        if not authorized(request):
            raise Refused(401, "missing or wrong bearer token (Authorization: Bearer ...)")

    return authorized, authorize


def _handlers(metrics: HealerMetrics, authorized: Callable[[Request], bool]
              ) -> dict[Any, Callable[[Request, Exception], Awaitable[Response]]]:
    def refusal(request: Request, status: int, message: str, field: str | None = None) -> Response:
        metrics.rejected.labels(_endpoint(request), str(status)).inc()
        return JSONResponse({"error": message, "field": field}, status_code=status)

    async def on_refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Refused)
        return refusal(request, exc.status, str(exc), exc.field)

    async def on_bad_request(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BadRequest)
        return refusal(request, 400, str(exc), exc.field)

    async def on_not_found(request: Request, exc: Exception) -> Response:
        return refusal(request, 404, str(exc))

    async def on_wrong_sender(request: Request, exc: Exception) -> Response:
        log.warning("refused a heartbeat batch: %s", exc)
        return refusal(request, 403, str(exc), "node")

    async def on_illegal(request: Request, exc: Exception) -> Response:
        return refusal(request, 409, str(exc), "state")

    async def on_database(request: Request, exc: Exception) -> Response:
        log.warning("database error answering %s %s: %s", request.method, request.url.path, exc)
        # NOTE: the driver's text names the database's host and user: for authenticated callers and the log only.
        detail = str(exc).splitlines()[0][:300] if str(exc) and authorized(request) else UNAVAILABLE
        return refusal(request, 503, f"database unavailable: {detail}")

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return refusal(request, exc.status_code, str(exc.detail))

    return {Refused: on_refused, BadRequest: on_bad_request, NotFound: on_not_found, IllegalTransition: on_illegal,
            WrongSender: on_wrong_sender,
            SQLAlchemyError: on_database, DatabaseError: on_database, HTTPException: on_http}


def _endpoint(request: Request) -> str:
    route = request.scope.get("route")
    return getattr(route, "path", "other")
