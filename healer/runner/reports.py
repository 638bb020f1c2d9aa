"""Where `megaheal run`'s node agents send their batches: a small HTTP endpoint of the embedded healer (the same
`POST /v1/heartbeats` as the service's, with the run's token), on loopback unless told otherwise, on a thread.
A batch carries the host's ranks' telemetry and, from a node agent, the host's part of the attempt (processes,
states, exits): both go into the healer's table, where the detectors read them."""

from __future__ import annotations

import hmac
import socket
import threading
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from healer.errors import BadRequest
from healer.observe.heartbeats import HeartbeatTable

MAX_BODY = 4 << 20


def create_app(table: HeartbeatTable, token: str) -> Starlette:
    expected = f"Bearer {token}".encode()

    async def heartbeats(request: Request) -> Response:
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            return JSONResponse({"error": "missing or wrong bearer token", "field": None}, status_code=401)
        body = await request.body()
        if len(body) > MAX_BODY:
            return JSONResponse({"error": f"body larger than {MAX_BODY} bytes", "field": "body"}, status_code=413)
        try:
            taken = table.ingest(body)
        except BadRequest as exc:
            return JSONResponse({"error": str(exc), "field": exc.field}, status_code=400)
        return JSONResponse({"accepted": taken}, status_code=202)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/heartbeats", heartbeats, methods=["POST"]),
                             Route("/healthz", healthz, methods=["GET"])])


class ReportServer:
    def __init__(self, table: HeartbeatTable, token: str, listen: str = "127.0.0.1:0",
                 advertise: str | None = None) -> None:
        self.table, self.token, self.listen, self.advertise = table, token, listen, advertise
        self._server: Any = None
        self.url = ""

    def start(self) -> str:
        """Serve; the URL the agents post to."""
        import uvicorn

        host, _, port = self.listen.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        config = uvicorn.Config(create_app(self.table, self.token), access_log=False, log_config=None,
                                limit_concurrency=256, timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="megaheal-reports",
                         daemon=True).start()
        deadline = time.monotonic() + 30
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the healer's report endpoint did not start on {self.listen}")
        self.url = f"http://{self.advertise or host}:{sock.getsockname()[1]}"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
