"""The healer's pages over HTTP (the rendering is healer/pages/, shared with `megaheal report --html`).

    GET  /                              -> /incidents
    GET  /incidents[?job=&state=&kind=&node=&offset=]   newest first, a page of them (PAGE_SIZE), each with its
                                        lost GPU-time; `offset` (a whole number, else a 400) pages to older ones
    GET  /incidents/{id}                one incident: stages, cost, decision, diagnosis, heat map, timeline
    POST /incidents/{id}/ack | resolve  a form with the API token (303 back to the incident)
    GET  /jobs/{job}                    goodput waterfall, loss and steps, attempts, its newest incidents
    GET  /jobs/{job}/trace.json         the Perfetto trace of every rank (where the run directory is known)

Reading needs no token (whoever reaches the healer may look; put it behind the same proxy as the API); acting
does, as on the API; so what a page costs must not grow with the incidents stored: a listing reads its page of
rows (SQL LIMIT) and their costs in a fixed number of statements (healer/pages/views.py incident_list), and an
incident's page reads that incident's timeline and cost alone (incident_ledger). Every page carries a
Content-Security-Policy that allows no script and no outside resource.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from healer.decide.states import IncidentState
from healer.engine.engine import Healer
from healer.errors import DatabaseError, IllegalTransition, NotFound
from healer.pages import render
from healer.pages.views import PAGE_SIZE, STATES, Filters, Sources, incident_list, incident_view, job_view
from healer.service.health import Readiness
from healer.service.requests import Refused, check_person

log = logging.getLogger(__name__)
MAX_FORM = 16 << 10
MAX_FILTER = 253
VERBS = {"ack": IncidentState.ACKNOWLEDGED, "resolve": IncidentState.RESOLVED}


class PageError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def secured(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = render.csp(served=True)
    for name, value in render.SECURITY_HEADERS.items():
        response.headers[name] = value
    return response


def page_routes(healer: Healer, readiness: Readiness, token: str, sources: Sources) -> list[Route]:
    expected = token.encode()

    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                if not readiness.ready:
                    # NOTE: not the reason: it names the database's host, port, user and name, and the pages are
                    # read without a token (the reason is logged, and shown by /readyz to a caller with one).
                    raise PageError(503, "database unavailable; try again")
                return secured(await handler(request))
            except PageError as exc:
                return _error(exc.status, str(exc))
            except NotFound as exc:
                return _error(404, str(exc))
            except IllegalTransition as exc:
                return _error(409, str(exc))
            except (SQLAlchemyError, DatabaseError) as exc:
                log.warning("database error answering %s %s: %s", request.method, request.url.path, exc)
                return _error(503, "database unavailable; try again")
        return run

    async def incidents(request: Request) -> Response:
        q = request.query_params
        filters = Filters(**{name: _text(q.get(name, ""), name) for name in ("job", "state", "kind", "node")})
        if filters.state and filters.state not in STATES:
            raise PageError(400, f"state must be one of {', '.join(STATES)}")
        offset = _number(q.get("offset", "0"), "offset")
        return await _html(lambda: render.incidents_page(incident_list(sources, filters, offset)))

    async def incident(request: Request) -> Response:
        incident_id = _number(request.path_params["id"], "incident")
        return await _html(lambda: render.incident_page(incident_view(sources, incident_id)))

    async def act(request: Request) -> Response:
        incident_id = _number(request.path_params["id"], "incident")
        new = VERBS.get(request.path_params["verb"])
        if new is None:
            raise PageError(404, "no such action: ack or resolve")
        form = await _form(request)
        # NOTE: constant-time, as on the API. The token in the form is also what keeps another site's page from
        # posting here in a person's name: it cannot know it.
        if not hmac.compare_digest(form.get("token", "").encode(), expected):
            raise PageError(401, "wrong or missing API token: ask whoever runs this healer for it")
        try:
            by, note = check_person(form.get("by", "").strip(), form.get("note", ""))
        except Refused as exc:  # NOTE: the API's own rule: what one refuses, the other must not store
            raise PageError(400, f"{exc.field}: {exc}") from None
        await run_in_threadpool(healer.person_action, incident_id, new, by, note)
        return RedirectResponse(f"/incidents/{incident_id}", status_code=303)

    async def job(request: Request) -> Response:
        name = _text(request.path_params["job"], "job")
        return await _html(lambda: render.job_page(job_view(sources, name, limit=PAGE_SIZE)))

    async def trace(request: Request) -> Response:
        from exporters.timeline import build_trace, read_rank_files

        name = _text(request.path_params["job"], "job")
        run = sources.run_for(name)
        if run is None:
            raise PageError(404, f"the run directory of job {name} is not known to this healer (run_roots)")
        try:
            body = await run_in_threadpool(lambda: build_trace(read_rank_files(run.path)[0]))
        except ValueError as exc:  # no step record yet
            raise PageError(404, f"job {name}: {exc}") from exc
        return JSONResponse(body, headers={"Content-Disposition": 'attachment; filename="trace.json"'})

    async def home(request: Request) -> Response:
        return RedirectResponse("/incidents", status_code=302)

    return [
        Route("/", home, methods=["GET"]),
        Route("/incidents", guarded(incidents), methods=["GET"]),
        Route("/incidents/{id}", guarded(incident), methods=["GET"]),
        Route("/incidents/{id}/{verb}", guarded(act), methods=["POST"]),
        Route("/jobs/{job}", guarded(job), methods=["GET"]),
        Route("/jobs/{job}/trace.json", guarded(trace), methods=["GET"]),
    ]


async def _html(page: Callable[[], str]) -> Response:
    """A page read and rendered in a worker thread (database reads and templates would hold the event loop)."""
    return HTMLResponse(await run_in_threadpool(page))


def _error(status: int, message: str) -> Response:
    return secured(HTMLResponse(render.error_page(status, message), status_code=status))


def _text(value: str, name: str) -> str:
    if len(value) > MAX_FILTER:
        raise PageError(400, f"{name}: at most {MAX_FILTER} characters")
    return value


def _number(value: str, name: str) -> int:
    # NOTE: ASCII digits only: "²".isdigit() is True and int("²") raises (a 500 on /incidents/%C2%B2)
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise PageError(400 if name == "offset" else 404, f"{name} must be a whole number, got {value[:40]!r}")
    return int(value)


async def _form(request: Request) -> dict[str, Any]:
    """An urlencoded form of at most MAX_FORM bytes (the ack and resolve forms), first value of each field."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
        raise PageError(415, "expected a form (application/x-www-form-urlencoded)")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM:
            raise PageError(413, f"form larger than {MAX_FORM} bytes")
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=10)
    except (UnicodeDecodeError, ValueError) as exc:
        raise PageError(400, "malformed form") from exc
    return {k: v[0] for k, v in fields.items()}
