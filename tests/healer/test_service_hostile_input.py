"""Hostile requests against a real `megaheal healer` (uvicorn with httptools, as deployed): every malformed path,
query and body is a 400 naming the field, never a 500; an unauthenticated caller learns nothing about the
database; connections beyond the configured bound are refused at once instead of piling up."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.healer.services import HealerProcess, Postgres, http, status_of, wait_for, webhook

pytestmark = pytest.mark.services

RULES = "- name: xid\n  when: {alert: GpuXid}\n  remediate: notify\n"
HEARTBEAT = {"schema": 1, "node": "n1", "seq": 0, "sent_at": 1, "ranks": []}


@pytest.fixture(scope="module")
def healer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HealerProcess]:
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "rules.yaml").write_text(RULES)
    proc = HealerProcess(tmp, {"db": f"sqlite:///{tmp / 'h.db'}", "rules": [str(tmp / "rules.yaml")]}).start()
    try:
        yield proc
    finally:
        proc.stop()
    assert "Traceback" not in proc.log.read_text()


@pytest.mark.parametrize(("path", "field"), [
    ("/v1/incidents/%C2%B2", "id"),                 # "²".isdigit() is True, int("²") raises
    ("/v1/incidents/%D9%A3", "id"),                 # ARABIC-INDIC DIGIT THREE: a Unicode digit int() takes
    ("/v1/incidents/" + "9" * 5000, "id"),          # int() refuses more than 4,300 digits
    ("/v1/incidents/%00", "id"),
    ("/v1/incidents/%FF%FE", "id"),                 # not UTF-8 once decoded
    ("/v1/incidents?limit=%C2%B3", "limit"),
    ("/v1/incidents?limit=-1", "limit"),
    ("/v1/incidents?limit=1&limit=2", "limit"),
    ("/v1/incidents?offset=" + "9" * 5000, "offset"),
    ("/v1/incidents?offset=%EF%BC%91", "offset"),   # FULLWIDTH DIGIT ONE
    ("/v1/incidents?state=" + "x" * 5000, "state"),
    ("/v1/incidents?limt=5", "limt"),               # a misspelt parameter is not silently ignored
])
def test_it_answers_malformed_paths_and_queries_with_400_naming_the_field_without_a_token(
        healer: HealerProcess, path: str, field: str) -> None:
    status, body = http("GET", healer.url + path, token=None)
    assert status == 400 and body["field"] == field, (status, body)
    assert len(body["error"]) < 300  # a 5,000-digit value is not echoed back


@pytest.mark.parametrize(("path", "raw", "field", "text"), [
    ("/v1/alertmanager", b"[" * 200000, "body", "nested too deeply"),
    ("/v1/alertmanager", b'{"version": "4", "alerts": [' + b"1" * 5000 + b"]}", "body", "out of range"),
    ("/v1/alertmanager", b'{"version": "4", "alerts": [], "x": NaN}', "body", "invalid JSON"),
    ("/v1/heartbeats", b"[" * 200000, "body", ""),
    ("/v1/heartbeats", b'{"schema": 1, "future": ' + b"[" * 200000 + b"}", "body", "nested too deeply"),
    ("/v1/heartbeats", json.dumps({**HEARTBEAT, "seq": "x"}).encode().replace(b'"x"', b"9" * 5000), "seq", ""),
    ("/v1/incidents/1/ack", b"[" * 200000, "body", "nested too deeply"),
    ("/v1/incidents/1/ack", b'{"by": ' + b"9" * 5000 + b"}", "body", "out of range"),
    ("/v1/incidents/1/ack", json.dumps({"by": "x" * 200}).encode(), "by", "1-128"),
    ("/v1/incidents/1/ack", json.dumps({"by": "ann\u0000"}).encode(), "by", "printable"),
    ("/v1/incidents/1/resolve", json.dumps({"note": "a\u0000b"}).encode(), "note", "control characters"),
])
def test_it_answers_malformed_bodies_with_400_naming_the_field(healer: HealerProcess, path: str, raw: bytes,
                                                               field: str, text: str) -> None:
    status, body = http("POST", healer.url + path, raw=raw)
    assert status == 400 and body["field"] == field and text in body["error"], (status, body)


def test_it_tells_an_unauthenticated_caller_only_whether_it_is_ready(tmp_path: Path, postgres: Postgres) -> None:
    # A database that does not exist yet: /readyz fails with the driver's words, which name host and user.
    name = f"absent_{time.monotonic_ns()}"
    (tmp_path / "rules.yaml").write_text("")
    healer = HealerProcess(tmp_path, {"db": postgres.url(name), "rules": [str(tmp_path / "rules.yaml")]})
    try:
        healer.start(wait_ready=False)
        hidden = [http("GET", f"{healer.url}/readyz", token=None), http("GET", f"{healer.url}/v1/incidents", token=None),
                  http("GET", f"{healer.url}/v1/incidents/1", token=None)]
        for status, body in hidden:
            assert status == 503, body
            assert name not in json.dumps(body) and postgres.user not in json.dumps(body) and "127.0.0.1" not in json.dumps(body)
        assert hidden[0][1] == {"ready": False, "database": hidden[0][1]["database"]}
        status, body = http("GET", f"{healer.url}/readyz")  # with the token: the reason, for whoever runs it
        assert status == 503 and name in body["database"] and "cannot reach the database" in body["database"]
        assert name in healer.log.read_text()  # and the log has it
    finally:
        healer.stop()


def _open_idle(url: str, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    return [socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0)) for _ in range(n)]


def test_one_client_cannot_fill_the_bound_and_many_that_do_are_refused_at_once_until_they_close(
        tmp_path: Path) -> None:
    # max_connections 8: one address may hold 2 (a quarter); connections that send nothing close after 10 s
    # (ground/http_serving.py). One client's 12 idle connections leave the healer serving; four clients' 3 each
    # fill it, and it answers 503 at once until they close.
    (tmp_path / "rules.yaml").write_text("")
    healer = HealerProcess(tmp_path, {"db": f"sqlite:///{tmp_path / 'h.db'}", "rules": [str(tmp_path / "rules.yaml")],
                                      "max_connections": 8}).start()
    idle: list[socket.socket] = []
    try:
        idle = _open_idle(healer.url, 12, "127.0.0.9")
        time.sleep(0.5)
        assert status_of(f"{healer.url}/healthz") == 200  # from another address (127.0.0.1)
        for s in idle:
            s.close()
        idle = [s for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
                for s in _open_idle(healer.url, 3, source)]
        wait_for("the bound to be reached", lambda: status_of(f"{healer.url}/healthz") == 503, 10)
        for s in idle:
            s.close()
        idle = []
        wait_for("service once they closed", lambda: status_of(f"{healer.url}/healthz") == 200, 10)
    finally:
        for s in idle:
            s.close()
        healer.stop()


def test_an_alert_batch_and_heartbeats_still_work_after_the_hostile_requests(healer: HealerProcess) -> None:
    alerts = webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "node": "n1"}}])
    status, body = http("POST", f"{healer.url}/v1/alertmanager", alerts)
    assert status == 200 and body["firing"] == 1
    assert http("POST", f"{healer.url}/v1/heartbeats", HEARTBEAT) == (202, {"accepted": 0})
    assert http("GET", f"{healer.url}/readyz")[0] == 200

