"""Fuzz: Alertmanager webhook payloads posted to the healer's API, stored in a real PostgreSQL. A well-formed
payload is stored whole whatever its labels hold (NUL characters, values longer than the columns): 200 with
every alert counted and none failed. Any other payload is refused with a 400 naming the field and stores
nothing; nothing is ever a 5xx."""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.unit

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from starlette.testclient import TestClient

from healer.engine.engine import Healer
from healer.incidents.db import ensure_schema
from healer.oncall.alertmanager import INCIDENT_ALERTNAME
from healer.service.api import create_app
from healer.service.health import Readiness
from tests.fuzz.json_strategies import DEEP, JSON, TEXT, mutated
from tests.healer.conftest import postgres  # noqa: F401 - the session's PostgreSQL, for this module too
from tests.healer.helpers import make_healer
from tests.healer.services import TOKEN, Postgres, webhook

AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
RULES = "- name: xid\n  when: {alert: GpuXid}\n  remediate: notify\n"
KEYS = st.one_of(st.sampled_from(["job", "node", "instance", "hostname", "severity", "xid"]), TEXT)
NAMES = st.one_of(st.sampled_from(["GpuXid", "GpuXid", "Other", INCIDENT_ALERTNAME]), st.text(min_size=1, max_size=30))


@st.composite
def alerts(draw: st.DrawFn) -> dict[str, Any]:
    labels = draw(st.dictionaries(KEYS, TEXT, max_size=5))
    labels["alertname"] = draw(NAMES)
    alert: dict[str, Any] = {"status": draw(st.sampled_from(["firing", "resolved"])), "labels": labels}
    if draw(st.booleans()):
        alert["annotations"] = draw(st.dictionaries(st.one_of(st.sampled_from(["summary", "description"]), TEXT),
                                                    TEXT, max_size=3))
    if draw(st.booleans()):
        alert["generatorURL"] = draw(JSON)  # a field the healer does not read: anything goes
    return alert


PAYLOADS = st.lists(alerts(), max_size=5).map(webhook)


@pytest.fixture(scope="module")
def service(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
            ) -> Iterator[tuple[TestClient, Healer]]:
    name = f"fuzz_{uuid.uuid4().hex[:12]}"
    healer = make_healer(tmp_path_factory.mktemp("alertmanager"), RULES, db_url=postgres.create_database(name))
    readiness = Readiness(lambda: ensure_schema(healer.store.engine))
    readiness.probe()
    try:
        with TestClient(create_app(healer, readiness, TOKEN), raise_server_exceptions=False) as client:
            yield client, healer
    finally:
        healer.store.engine.dispose()
        postgres.drop_database(name)


def _stored(healer: Healer) -> tuple[int, int]:
    with healer.store.engine.connect() as conn:
        return (int(conn.execute(sa.text("SELECT count(*) FROM incidents")).scalar_one()),
                int(conn.execute(sa.text("SELECT count(*) FROM incident_events")).scalar_one()))


def _post(service: tuple[TestClient, Healer], body: bytes) -> tuple[int, Any]:
    client, healer = service
    before = _stored(healer)
    r = client.post("/v1/alertmanager", content=body, headers=AUTH)
    assert r.status_code in (200, 400), (r.status_code, r.text)
    if r.status_code == 400:
        assert r.json()["field"] and r.json()["error"], r.json()
        assert _stored(healer) == before, "a refused payload stored something"
    return r.status_code, r.json()


@given(PAYLOADS)
def test_a_well_formed_payload_is_stored_whole_whatever_its_labels_hold(service: tuple[TestClient, Healer],
                                                                        payload: dict[str, Any]) -> None:
    status, answer = _post(service, json.dumps(payload).encode())
    ours = [a for a in payload["alerts"] if a["labels"]["alertname"] == "GpuXid"]
    assert status == 200, answer
    assert answer["failed"] == 0 and "errors" not in answer, answer
    assert answer["firing"] == sum(a["status"] == "firing" for a in ours)
    assert answer["resolved"] == sum(a["status"] == "resolved" for a in ours)


@given(PAYLOADS.flatmap(lambda p: mutated(p)))
def test_a_mutated_payload_is_stored_or_refused_naming_the_field(service: tuple[TestClient, Healer],
                                                                 case: tuple[Any, int]) -> None:
    doc, _ = case
    status, answer = _post(service, json.dumps(doc).encode())
    assert status == 400 or answer["failed"] == 0, answer


@given(st.one_of(JSON.map(lambda v: json.dumps(v).encode()), DEEP, st.binary(max_size=200)))
def test_any_body_is_stored_or_refused_never_a_server_error(service: tuple[TestClient, Healer], body: bytes) -> None:
    _post(service, body)
