"""What the healer's watcher (healer/runner/watch.py) makes of the healer's report endpoint: an answer over TLS from
the run's healer certificate is `ok`; a refused connection (the host answers, no healer listens) is `refused`, which
never hands the job over; a host that accepts nothing in time is `silent`; and a server with another role's
certificate is not the healer."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from healer.launchers.run_authority import RunAuthority
from healer.runner.watch import Handover, Watch
from wire.run_paths import RunPaths

pytestmark = pytest.mark.unit


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/healthz" else 404)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def _serve(ctx: ssl.SSLContext) -> Iterator[int]:
    server = HTTPServer(("127.0.0.1", 0), _Health)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    RunAuthority.of_run(RunPaths(tmp_path).launcher)
    return tmp_path


def _watch(run_dir: Path, port: int) -> Watch:
    RunPaths(run_dir).healer_url.write_text(f"https://127.0.0.1:{port}\n")
    return Watch(run_dir=run_dir, batch_host="mh1", job_id="12", probe_timeout_s=0.5)


def test_the_healer_answering_over_tls_is_ok_and_a_refused_port_is_a_live_host(run_dir: Path) -> None:
    authority = RunAuthority.of_run(RunPaths(run_dir).launcher)
    for port in _serve(authority.healer().server(require_peer=False)):
        assert _watch(run_dir, port).probe() == "ok"
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    assert _watch(run_dir, port).probe() == "refused"


def test_a_host_that_accepts_nothing_in_time_is_silent_and_so_is_another_roles_server(run_dir: Path) -> None:
    deaf = socket.socket()
    deaf.bind(("127.0.0.1", 0))
    deaf.listen(1)  # NOTE: never accepted: the TLS handshake gets no answer
    try:
        assert _watch(run_dir, deaf.getsockname()[1]).probe() == "silent"
    finally:
        deaf.close()
    authority = RunAuthority.of_run(RunPaths(run_dir).launcher)
    for port in _serve(authority.host("mh2").server(require_peer=False)):
        assert _watch(run_dir, port).probe() == "silent", "a host's certificate is not the healer's"
    assert Handover.read(run_dir) is None


def test_a_watch_is_refused_a_bad_host_name_or_job_id(run_dir: Path) -> None:
    with pytest.raises(ValueError, match="batch host"):
        Watch(run_dir=run_dir, batch_host="mh1;reboot", job_id="12")
    with pytest.raises(ValueError, match="job id"):
        Watch(run_dir=run_dir, batch_host="mh1", job_id="12; rm -rf /")
