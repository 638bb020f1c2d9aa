"""Where `megaheal run`'s node agents send their batches: the healer's one HTTP API (healer/service/api.py, the same
app as the service's, with the run's token), served on a thread, on loopback unless the launcher says otherwise. A
batch carries the host's ranks' telemetry and, from a node agent, the host's part of the attempt (processes, states,
exits): both go into the healer's table, where the detectors read them."""

from __future__ import annotations

import ssl
import threading
import time
from typing import Any

from starlette.applications import Starlette


class ReportServer:
    def __init__(self, app: Starlette, listen: str = "127.0.0.1:0", advertise: str | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the healer's server context (ground/tls.py): the agents then report over mutual TLS, each batch
        taken on its host's certificate (healer/service/api.py)."""
        self.app, self.listen, self.advertise, self.tls = app, listen, advertise, tls
        self._server: Any = None
        self.url = ""

    def start(self) -> str:
        """Serve; the URL the agents post to."""
        import uvicorn

        from ground.http_serving import guarded_h11, listening_socket, tls_config

        host = self.listen.rpartition(":")[0]
        sock = listening_socket(self.listen)
        config = uvicorn.Config(self.app, access_log=False, log_config=None, http=guarded_h11(per_peer=64),
                                limit_concurrency=256, timeout_graceful_shutdown=2,
                                **(tls_config(self.tls) if self.tls is not None else {}))
        self._server = uvicorn.Server(config)
        threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="megaheal-reports",
                         daemon=True).start()
        deadline = time.monotonic() + 30
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the healer's report endpoint did not start on {self.listen}")
        self.url = f"{'https' if self.tls else 'http'}://{self.advertise or host}:{sock.getsockname()[1]}"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
