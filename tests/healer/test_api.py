"""The HTTP API in process (Starlette's TestClient): tokens, body limits, and every kind of bad input answered
with a 4xx naming the field, never a 500."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

with warnings.catch_warnings():
    # NOTE: Starlette 1.x suggests httpx2 for its TestClient; httpx still works and is what dev installs.
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from starlette.testclient import TestClient

from healer.engine.engine import Healer
from healer.incidents.db import ensure_schema
from healer.service.api import create_app
from healer.service.health import Readiness
from tests.healer.helpers import batch, make_healer
from tests.healer.services import TOKEN, webhook

AUTH = {"Authorization": f"Bearer {TOKEN}"}
RULES = '- name: xid\n  when: {alert: GpuXid}\n'
FIRING = webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "node": "n1", "job": "j"}}])


@pytest.fixture
def healer(tmp_path: Path) -> Healer:
    return make_healer(tmp_path, RULES)


@pytest.fixture
def client(healer: Healer) -> Iterator[TestClient]:
    readiness = Readiness(lambda: ensure_schema(healer.store.engine))
    readiness.probe()
    with TestClient(create_app(healer, readiness, TOKEN), raise_server_exceptions=False) as c:
        yield c


MUTATING = [("/v1/heartbeats", batch("n1", [0])), ("/v1/alertmanager", FIRING),
            ("/v1/incidents/1/ack", {}), ("/v1/incidents/1/resolve", {})]


@pytest.mark.parametrize(("path", "body"), MUTATING)
def test_mutating_endpoints_need_the_bearer_token(client: TestClient, path: str, body: Any) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = client.post(path, json=body, headers=headers)
        assert r.status_code == 401 and "bearer token" in r.json()["error"]


def test_reads_need_no_token_and_writes_with_it_work(client: TestClient) -> None:
    assert client.post("/v1/heartbeats", json=batch("n1", [0, 1]), headers=AUTH).json() == {"accepted": 2}
    assert client.post("/v1/alertmanager", json=FIRING, headers=AUTH).json()["firing"] == 1
    (incident,) = client.get("/v1/incidents").json()["incidents"]
    assert client.get("/v1/incidents?state=open").json()["incidents"] == [incident]
    assert client.get("/v1/incidents?state=resolved").json()["incidents"] == []
    acked = client.post(f"/v1/incidents/{incident['id']}/ack", json={"by": "ann", "note": "looking"}, headers=AUTH)
    assert acked.status_code == 200 and acked.json()["acknowledged_by"] == "person:ann"
    resolved = client.post(f"/v1/incidents/{incident['id']}/resolve", headers=AUTH)
    assert resolved.json()["state"] == "resolved"
    events = client.get(f"/v1/incidents/{incident['id']}").json()["events"]
    assert [(e["from"], e["to"]) for e in events] == [(None, "open"), ("open", "acknowledged"), ("acknowledged", "resolved")]
    assert all(e["at"] for e in events) and events[1]["evidence"] == {"by": "ann", "note": "looking", "via": "api"}
    again = client.post(f"/v1/incidents/{incident['id']}/resolve", headers=AUTH)
    assert again.status_code == 409 and "from resolved to resolved" in again.json()["error"]


def test_bodies_over_one_mebibyte_are_refused(client: TestClient) -> None:
    big = json.dumps({"schema": 1, "pad": "x" * (1 << 20)})
    r = client.post("/v1/heartbeats", content=big, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while streaming
        for _ in range(17):
            yield b" " * 65536

    r = client.post("/v1/alertmanager", content=chunks(), headers=AUTH)
    assert r.status_code == 413


@pytest.mark.parametrize(("path", "raw", "field", "text"), [
    ("/v1/heartbeats", b"{not json", "body", "invalid JSON at line 1 column 2"),
    ("/v1/heartbeats", b"", "body", "empty body"),
    ("/v1/heartbeats", b'{"node": "\xc3\x28"}', "body", "not UTF-8"),
    ("/v1/heartbeats", b"[]", "body", "expected a JSON object"),
    ("/v1/heartbeats", b'{"schema": 2}', "schema", "expected 1, got 2"),
    ("/v1/heartbeats", b'{"schema": 1, "node": "n1", "seq": 0, "sent_at": 1}', "ranks", "missing: expected a list"),
    ("/v1/heartbeats", b'{"schema": 1, "node": "n 1", "seq": 0, "sent_at": 1, "ranks": []}', "node", "expected a name"),
    ("/v1/heartbeats", b'{"schema": 1, "node": "n1", "seq": -1, "sent_at": 1, "ranks": []}', "seq", "integer >= 0"),
    ("/v1/heartbeats", b'{"schema": 1, "node": "n1", "seq": 0, "sent_at": "now", "ranks": []}', "sent_at", "finite number"),
    ("/v1/heartbeats", json.dumps({**batch("n1", [0]), "ranks": [{**batch("n1", [0])["ranks"][0], "rank": "0"}]}).encode(),
     "ranks[0].rank", "integer >= 0"),
    ("/v1/heartbeats", json.dumps({**batch("n1", [0]), "ranks": [{**batch("n1", [0])["ranks"][0], "alive": 1}]}).encode(),
     "ranks[0].alive", "true or false"),
    ("/v1/heartbeats", json.dumps({**batch("n1", [0]), "ranks": [{**batch("n1", [0])["ranks"][0], "job": None}]}).encode(),
     "ranks[0].job", "expected a name"),
    ("/v1/alertmanager", b'{"version": "3", "alerts": []}', "version", "expected \"4\""),
    ("/v1/alertmanager", b'{"version": "4"}', "alerts", "expected a list"),
    ("/v1/alertmanager", b'{"version": "4", "alerts": [{"status": "firing", "labels": {}}]}', "alerts[0].labels.alertname",
     "missing"),
    ("/v1/alertmanager", b'{"version": "4", "alerts": [{"status": "maybe", "labels": {"alertname": "x"}}]}',
     "alerts[0].status", "firing or resolved"),
    ("/v1/incidents/1/ack", b'{"by": 5}', "by", "a name of 1-128"),
    ("/v1/incidents/1/ack", b'[1]', "body", "JSON object"),
])
def test_malformed_bodies_are_400_naming_the_field(client: TestClient, path: str, raw: bytes, field: str, text: str) -> None:
    client.post("/v1/alertmanager", json=FIRING, headers=AUTH)
    r = client.post(path, content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field and text in r.json()["error"]


def test_unknown_fields_are_ignored(client: TestClient) -> None:
    payload = {**FIRING, "newField": {"x": 1}, "alerts": [{**FIRING["alerts"][0], "silenceURL": "x"}]}
    assert client.post("/v1/alertmanager", json=payload, headers=AUTH).status_code == 200
    assert client.post("/v1/heartbeats", json={**batch("n1", [0]), "future": True}, headers=AUTH).status_code == 202


@pytest.mark.parametrize(("method", "path", "status", "field"), [
    ("GET", "/v1/incidents/999", 404, None), ("GET", "/v1/incidents/abc", 400, "id"), ("GET", "/v1/incidents/0", 400, "id"),
    ("GET", "/v1/incidents?state=sleeping", 400, "state"), ("GET", "/v1/incidents?limit=100000", 400, "limit"),
    ("POST", "/v1/incidents/999/ack", 404, None), ("GET", "/v1/nothing", 404, None), ("DELETE", "/v1/incidents", 405, None),
])
def test_bad_paths_and_parameters_are_4xx(client: TestClient, method: str, path: str, status: int, field: str | None) -> None:
    r = client.request(method, path, headers=AUTH)
    assert r.status_code == status and r.json()["field"] == field


def test_health_readiness_and_metrics(client: TestClient) -> None:
    client.post("/v1/alertmanager", json=FIRING, headers=AUTH)
    client.post("/v1/heartbeats", content=b"{", headers=AUTH)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["ready"] is True
    text = client.get("/metrics").text
    assert 'megaheal_incidents_open{kind="gpuxid",severity="warning"} 1.0' in text
    assert 'megaheal_healer_requests_rejected_total{endpoint="/v1/heartbeats",status="400"} 1.0' in text


def test_a_database_that_goes_away_gives_503_and_a_failing_readyz(healer: Healer, tmp_path: Path) -> None:
    from healer.incidents.db import make_engine

    healer.store.engine = make_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    readiness = Readiness(lambda: ensure_schema(healer.store.engine))
    readiness.probe()
    with TestClient(create_app(healer, readiness, TOKEN), raise_server_exceptions=False) as client:
        ready = client.get("/readyz", headers=AUTH)
        assert ready.status_code == 503 and "cannot reach the database" in ready.json()["database"]
        r = client.post("/v1/alertmanager", json=FIRING, headers=AUTH)
        assert r.status_code == 503 and "database unavailable" in r.json()["error"]
        assert client.get("/v1/incidents").status_code == 503
        assert client.post("/v1/heartbeats", json=batch("n1", [0]), headers=AUTH).status_code == 202  # in memory
        assert "megaheal_incidents_open" not in client.get("/metrics").text  # left out, the scrape still works
