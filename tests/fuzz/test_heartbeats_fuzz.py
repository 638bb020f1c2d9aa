"""Fuzz: heartbeat batches posted to the healer's API. Every body is accepted (202, each rank entry taken) or
refused with a 400 naming the field, never a 5xx, and a refused batch leaves nothing in the heartbeat table."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.unit

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from starlette.testclient import TestClient

from healer.engine.engine import Healer
from healer.incidents.db import ensure_schema
from healer.service.api import create_app
from healer.service.health import Readiness
from tests.fuzz.json_strategies import DEEP, JSON, mutated
from tests.healer.helpers import batch, make_healer
from tests.healer.services import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
VALID = {**batch("n1", [0, 1]), "gpus": [{"gpu": 0, "uuid": "GPU-0", "last_xid": 79, "xid_counts": {"79": 1}}]}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Healer]]:
    healer = make_healer(tmp_path_factory.mktemp("heartbeats"), "")
    readiness = Readiness(lambda: ensure_schema(healer.store.engine))
    readiness.probe()
    with TestClient(create_app(healer, readiness, TOKEN), raise_server_exceptions=False) as client:
        yield client, healer


def _post(service: tuple[TestClient, Healer], body: bytes) -> tuple[int, Any]:
    client, healer = service
    before = (len(healer.table), healer.table.batches)
    r = client.post("/v1/heartbeats", content=body, headers=AUTH)
    assert r.status_code in (202, 400, 413), (r.status_code, r.text)
    answer = r.json()
    if r.status_code != 202:
        assert answer["error"] and (r.status_code == 413 or answer["field"]), answer
        assert (len(healer.table), healer.table.batches) == before, "a refused batch left something behind"
    return r.status_code, answer


@given(mutated(VALID))
def test_a_mutated_batch_is_taken_whole_or_refused_naming_the_field(service: tuple[TestClient, Healer],
                                                                     case: tuple[Any, int]) -> None:
    doc, changes = case
    status, answer = _post(service, json.dumps(doc).encode())
    if status == 202:
        assert answer == {"accepted": len(doc["ranks"])}
    assert changes or status == 202, answer


@given(st.one_of(st.binary(max_size=300), DEEP, JSON.map(lambda v: json.dumps(v).encode()),
                 st.text(max_size=300).map(str.encode)))
def test_any_body_is_taken_or_refused_never_a_server_error(service: tuple[TestClient, Healer], body: bytes) -> None:
    _post(service, body)
