"""The run's certificate authority and mutual TLS (healer/launchers/run_authority.py, ground/tls.py): a real
handshake on loopback, each party checked by the role and name its certificate carries."""

from __future__ import annotations

import socket
import ssl
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ground.httpclient import RequestFailed, request_json
from ground.tls import Identity, PeerConnection, PeerRefused, PeerTls, TlsFiles, https, identity_of
from healer.launchers.run_authority import RunAuthority

pytestmark = pytest.mark.unit


@pytest.fixture
def authority(tmp_path: Path) -> RunAuthority:
    return RunAuthority.of_run(tmp_path / "launcher")


def _serve_once(files: TlsFiles, require_peer: bool = True) -> tuple[int, dict[str, object]]:
    """A TLS server on loopback answering one HTTP request with 200 {}; what it saw of its peer lands in `seen`."""
    seen: dict[str, object] = {}
    ctx = files.server(require_peer)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def run() -> None:
        with listener:
            conn, _ = listener.accept()
            try:
                with ctx.wrap_socket(conn, server_side=True) as tls:
                    seen["peer"] = identity_of(tls.getpeercert())
                    tls.recv(65536)
                    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            except (ssl.SSLError, OSError) as exc:
                seen["error"] = exc

    threading.Thread(target=run, daemon=True).start()
    return port, seen


def test_it_makes_one_authority_per_run_and_keeps_keys_private(authority: RunAuthority, tmp_path: Path) -> None:
    host = authority.host("n1")
    assert RunAuthority.of_run(tmp_path / "launcher").ca_cert.read_bytes() == authority.ca_cert.read_bytes()
    for path in (authority.ca_key, host.key, host.cert):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert host.directory == tmp_path / "launcher" / "tls" / "hosts" / "n1"


def test_it_refuses_a_node_name_that_would_leave_its_directory(authority: RunAuthority) -> None:
    with pytest.raises(ValueError, match="node"):
        authority.host("a/../../etc")


def test_a_healer_reaches_the_host_it_asked_for(authority: RunAuthority) -> None:
    port, seen = _serve_once(authority.host("n2"))
    peer = PeerTls(authority.healer().client(), "host", "n2")
    assert request_json("GET", f"https://127.0.0.1:{port}/v1/state", tls=peer) == {}
    assert seen["peer"] == Identity("healer", "healer")


def test_a_host_that_answers_for_another_is_not_sent_the_request(authority: RunAuthority) -> None:
    port, seen = _serve_once(authority.host("n3"))
    peer = PeerTls(authority.healer().client(), "host", "n2")
    with pytest.raises(PeerRefused, match="host n3, not host n2"):
        https("POST", f"https://127.0.0.1:{port}/v1/orders", b"{}", {}, 5, peer, 1024)
    port, _ = _serve_once(authority.host("n3"))
    with pytest.raises(RequestFailed, match="not host n2") as failed:
        request_json("POST", f"https://127.0.0.1:{port}/v1/orders", {}, tls=peer)
    assert not failed.value.permanent  # as good as no answer: the host n2 was not reached


def test_a_certificate_of_another_run_fails_the_handshake(authority: RunAuthority, tmp_path: Path) -> None:
    stranger = RunAuthority.of_run(tmp_path / "other-run").healer()
    port, seen = _serve_once(authority.host("n1"))
    with pytest.raises(ssl.SSLError):
        https("GET", f"https://127.0.0.1:{port}/", None, {}, 5, PeerTls(stranger.client(), "host", "n1"), 1024)


def test_a_server_that_requires_a_peer_refuses_a_client_without_one(authority: RunAuthority) -> None:
    port, seen = _serve_once(authority.host("n1"))
    ctx = ssl.create_default_context(cafile=str(authority.ca_cert))
    ctx.check_hostname = False
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                ctx.wrap_socket(raw) as tls:
            tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            if not tls.recv(100):
                raise ConnectionError("closed")


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ca.pem is missing"):
        TlsFiles(tmp_path).client()


@pytest.fixture(autouse=True)
def _no_thread_left() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    for t in set(threading.enumerate()) - before:
        t.join(timeout=5)


def test_a_kept_connection_is_reused_and_opened_again_once_the_peer_closed_it(authority: RunAuthority) -> None:
    # The server answers one request on each connection, keeps it open as HTTP/1.1 does, then closes it (its
    # keep-alive ran out): the client's next request finds it closed, opens a new one and is answered there.
    ctx = authority.host("n2").server(True)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    served: list[int] = []

    def run() -> None:
        with listener:
            for n in (1, 2):
                conn, _ = listener.accept()
                with ctx.wrap_socket(conn, server_side=True) as tls:
                    for _ in range(2 if n == 1 else 1):
                        if not tls.recv(65536):
                            break
                        served.append(n)
                        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                    if n == 1:
                        time.sleep(0.3)  # two requests answered, then the keep-alive runs out

    threading.Thread(target=run, daemon=True).start()
    kept = PeerConnection(PeerTls(authority.healer().client(), "host", "n2"))
    url = f"https://127.0.0.1:{port}/v1/state"
    try:
        assert kept.request("GET", url, None, {}, 5, 1024) == (200, b"{}")
        first = kept._conn
        assert kept.request("GET", url, None, {}, 5, 1024) == (200, b"{}")
        assert kept._conn is first, "one handshake for both"
        time.sleep(0.6)
        assert kept.request("GET", url, None, {}, 5, 1024) == (200, b"{}")
        assert kept._conn is not first and served == [1, 1, 2]
    finally:
        kept.close()
