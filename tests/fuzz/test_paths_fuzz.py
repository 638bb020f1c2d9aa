"""Fuzz: path and query parameters sent to a real `megaheal healer` (uvicorn with httptools, as deployed), with
and without the token. Whatever the bytes, the answer is a 2xx or 4xx, never a 5xx; the healer's own 400s are JSON
naming the field."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.json_strategies import TEXT
from tests.healer.services import TOKEN, HealerProcess, http, webhook

pytestmark = pytest.mark.unit

KEYS = st.one_of(st.sampled_from(["state", "limit", "offset"]), TEXT)
STATES = st.sampled_from(["open", "resolved", "escalated", "OPEN", ""])
NUMBERS = st.one_of(st.integers(-5, 2**64).map(str), STATES, TEXT)
# Bytes as a careless client sends them: percent-encoded, or raw (httptools refuses what is not a valid request).
ENCODED = st.one_of(TEXT.map(lambda t: quote(t, safe="")), st.binary(max_size=20).map(lambda b: quote(b, safe="")),
                    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7e), max_size=20))


@pytest.fixture(scope="module")
def healer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HealerProcess]:
    tmp = tmp_path_factory.mktemp("paths")
    (tmp / "rules.yaml").write_text("- name: xid\n  when: {alert: GpuXid}\n  remediate: notify\n")
    proc = HealerProcess(tmp, {"db": f"sqlite:///{tmp / 'h.db'}", "rules": [str(tmp / "rules.yaml")]}).start()
    alerts = webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "node": f"n{i}"}} for i in range(3)])
    assert http("POST", f"{proc.url}/v1/alertmanager", alerts)[0] == 200
    try:
        yield proc
    finally:
        proc.stop()
    assert "Traceback" not in proc.log.read_text()


def _request(healer: HealerProcess, method: str, target: str, token: bool) -> tuple[int, bytes]:
    """One raw HTTP/1.1 request (no client-side checks of the target); (status, body)."""
    head = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: 0\r\n"
    if token:
        head += f"Authorization: Bearer {TOKEN}\r\n"
    with socket.create_connection(("127.0.0.1", healer.port), timeout=10) as sock:
        sock.sendall(head.encode("latin-1", errors="replace") + b"\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split(b" ")[1]), rest.partition(b"\r\n\r\n")[2]


def _check(status: int, body: bytes) -> None:
    assert status < 500, (status, body[:300])
    if status == 400 and body.startswith(b"{"):
        answer = json.loads(body)
        assert answer["error"] and answer["field"], answer


@given(ENCODED, st.sampled_from(["", "/ack", "/resolve"]), st.booleans())
def test_an_incident_path_is_answered_or_refused_never_a_server_error(healer: HealerProcess, segment: str,
                                                                      action: str, token: bool) -> None:
    method = "POST" if action else "GET"
    _check(*_request(healer, method, f"/v1/incidents/{segment}{action}", token))


@given(st.lists(st.tuples(KEYS, NUMBERS), max_size=4), st.booleans(), st.booleans())
def test_a_query_is_answered_or_refused_never_a_server_error(healer: HealerProcess, params: list[tuple[str, str]],
                                                            encode: bool, token: bool) -> None:
    text = "&".join(f"{quote(k, safe='') if encode else k}={quote(v, safe='') if encode else v}" for k, v in params)
    _check(*_request(healer, "GET", f"/v1/incidents?{text}", token))
