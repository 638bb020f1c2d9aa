"""Fuzz: the node agent's orders API (healer/agent/api.py) in process, on an agent whose orders do nothing (no
torchrun, no runbook, no signal: only the API and the order book are real). Whatever the body, path or
Authorization header: never a 5xx; every 4xx is JSON with an "error"; without the token a 401 and nothing taken; an
order is taken exactly when the wire types (wire/orders.py `decode_order`) take it, and an order taken is found
again under its id."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.unit

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from starlette.testclient import TestClient

from healer.agent.api import MAX_BODY, create_app
from healer.agent.node import NodeAgent
from tests.fuzz.json_strategies import DEEP, JSON, TEXT, mutated
from wire.orders import ENV_KEYS, StartOrder, decode_order

TOKEN = "agent-fuzz-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


class _Sidecar:
    def start(self) -> None: ...

    def stop(self) -> None: ...


class HarmlessAgent(NodeAgent):
    """A node agent whose orders are only recorded: the API and the order book are real, nothing is started."""

    def __init__(self, cfg: NodeAgent.Config) -> None:
        super().__init__(cfg, _Sidecar(), lambda url, build: None)  # type: ignore[arg-type,return-value]
        self.submitted = 0

    def submit(self, order: Any) -> tuple[Any, bool]:
        self.submitted += 1
        return super().submit(order)

    def _execute(self, order: Any) -> Any:
        return None


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, HarmlessAgent]]:
    tmp: Path = tmp_path_factory.mktemp("agent")
    node = HarmlessAgent(NodeAgent.Config(node="n1", token=TOKEN, socket_path=str(tmp / "r.sock"),
                                          work_dir=tmp / "work", scratch_dir=tmp / "scratch"))
    node.orders.start()
    try:
        with TestClient(create_app(node), raise_server_exceptions=False) as client:
            yield client, node
    finally:
        node.orders.stop()


# ---- orders: one valid one of each kind, and values a hostile or careless healer could put in them ------------------

def _order(doc: dict[str, Any]) -> dict[str, Any]:
    # NOTE: the orders' epoch field, where the wire types have it (a newer healer's orders carry one).
    return {**doc, "epoch": 3} if "epoch" in StartOrder.__struct_fields__ else doc


START = {"kind": "start", "id": "j-0:start:n1", "job": "j", "attempt": 0, "nnodes": 2, "node_rank": 1,
         "nproc_per_node": 4, "rdzv_endpoint": "10.0.0.1:29500", "config": "/srv/configs/tiny.yaml",
         "run_dir": "/runs/j", "overrides": ["steps=200", "job=j"], "env": {"NCCL_DEBUG": "INFO"}}
VALID = [_order(d) for d in (
    START,
    {k: v for k, v in START.items() if k != "config"} | {"program": {"module": False, "target": "/srv/train.py",
                                                                     "args": ["--lr", "1e-4"], "cwd": "/srv"}},
    START | {"warm": {"control": "h0:29400", "formed_in": 0, "assign": {"w0": 4}, "local_rank": {"w0": 0}}},
    {"kind": "stop", "id": "j-0:stop:n1", "attempt": 0, "grace_s": 0.5},
    {"kind": "signal", "id": "kill-3", "attempt": 0, "rank": 3, "signal": "SIGKILL"},
    {"kind": "runbook", "id": "runbook:n1:node-health:1", "runbook": "node-health", "timeout_s": 90},
    {"kind": "report", "id": "report:n1:1", "healer_url": "https://healer.example:8443"},
    {"kind": "adopt", "id": "adopt:n1", "job": "j", "attempt": 0, "node_rank": 1},
    {"kind": "evidence", "id": "evidence:n1", "attempt": 0, "timeout_s": 10},
    {"kind": "workers", "id": "workers:n1"},
    {"kind": "shutdown", "id": "shutdown:n1"},
)]
HOSTILE = st.one_of(JSON, st.sampled_from([
    2**63, 2**64, -1, -(2**63) - 1, 10**30, 1e308, 0.0, -0.0, True, "", " ", "x" * 5000, "é", "\U0001d518", "a\x00b",
    "../../etc/passwd", "/runs/../../etc/shadow", "/", "job/../../x", "a/..", "id\n", "$(reboot)", "`id`",
    "SIGSEGV", "sigkill", "10.0.0.1:99999", "[::1]:1", "file:///etc/passwd", "http://x\n", "node-health\n",
    ["--set", "x=\x00"], {"LD_PRELOAD": "/tmp/x.so"}, {"NCCL_NET_PLUGIN": "/tmp/evil.so"},
    {"CUDA_INJECTION64_PATH": "/tmp/x"}, {"OMP_NUM_THREADS\n": "1"}, {"NCCL_DEBUG": "a\x00"},
    "[" * 100 + "]" * 100]))
ENV = st.dictionaries(st.one_of(st.sampled_from(sorted(ENV_KEYS)), st.sampled_from(
    ["LD_PRELOAD", "PATH", "PYTHONPATH", "NCCL_TUNER_PLUGIN", "TORCH_EXTENSIONS_DIR", "nccl_debug", ""]), TEXT),
    TEXT, max_size=4)


@st.composite
def hostile_orders(draw: st.DrawFn) -> dict[str, Any]:
    """A valid order of any kind with some of its fields (or one added) given hostile values."""
    doc = dict(draw(st.sampled_from(VALID)))
    for key in draw(st.lists(st.sampled_from([*sorted(doc), "extra", "env", "id"]), min_size=1, max_size=3)):
        if key == "kind":
            continue
        doc[key] = draw(ENV) if key == "env" and draw(st.booleans()) else draw(HOSTILE)
    return doc


def _wire_takes(body: bytes) -> Any:
    """The decoded order, or None where the wire types refuse the body."""
    try:
        return decode_order(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None


def _refusal(r: Any) -> dict[str, Any]:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    answer = r.json()
    assert isinstance(answer, dict) and isinstance(answer.get("error"), str) and answer["error"], answer
    return answer


def _post(agent: tuple[TestClient, HarmlessAgent], body: bytes) -> None:
    client, node = agent
    r = client.post("/v1/orders", content=body, headers=AUTH)
    order = _wire_takes(body) if len(body) <= MAX_BODY else None
    if order is None:
        assert r.status_code in (400, 413), (r.status_code, r.text[:300], body[:200])
        _refusal(r)
        return
    # Taken, or a conflict with an order taken before under the same id (or from a newer healer).
    assert r.status_code in (202, 409), (r.status_code, r.text[:300])
    if r.status_code == 409:
        assert _refusal(r)["field"] in ("id", "epoch")
        return
    assert r.json()["id"] == order.id and node.orders.get(order.id) is not None
    again = client.get(f"/v1/orders/{quote(order.id, safe='')}", headers=AUTH)
    assert again.status_code == 200 and again.json()["id"] == order.id, (order.id, again.text[:300])


# ---- properties -------------------------------------------------------------------------------------------------

@given(st.one_of(hostile_orders(), st.sampled_from(VALID).flatmap(lambda v: mutated(v).map(lambda m: m[0]))))
def test_an_order_is_taken_exactly_when_the_wire_types_take_it(agent: tuple[TestClient, HarmlessAgent],
                                                               doc: dict[str, Any]) -> None:
    _post(agent, json.dumps(doc).encode())


@given(st.one_of(st.binary(max_size=300), DEEP, JSON.map(lambda v: json.dumps(v).encode()),
                 st.text(max_size=300).map(str.encode)))
def test_any_body_is_taken_or_refused_never_a_server_error(agent: tuple[TestClient, HarmlessAgent],
                                                           body: bytes) -> None:
    _post(agent, body)


HEADER_BYTES = st.binary(max_size=60).map(lambda b: bytes(c for c in b if c not in b"\r\n\x00"))
# Headers that hold the token but do not carry it as a bearer token, and some that come close.
NEAR_MISSES = [b"", b"Bearer", b"Bearer ", TOKEN.encode(), b"Basic " + TOKEN.encode(), b"Token " + TOKEN.encode(),
               b"Bearer " + TOKEN[:-1].encode(), b"Bearer " + TOKEN.encode() + b"x", b"Bearer\t" + TOKEN.encode(),
               b"Bearer " + TOKEN.upper().encode(), b"Bearer " + TOKEN.encode() + b"\xff", b"Bearer" + TOKEN.encode(),
               b"Bearer " + TOKEN.encode() + b" " + TOKEN.encode(), b"Bearer x " + TOKEN.encode()]
WRONG_AUTH = st.one_of(st.none(), st.sampled_from(NEAR_MISSES),
                       st.one_of(HEADER_BYTES, HEADER_BYTES.map(lambda b: b"Bearer " + b)).filter(
                           lambda b: TOKEN.encode() not in b))
ROUTES = st.sampled_from([("POST", "/v1/orders"), ("GET", "/v1/orders/kill-3"), ("GET", "/v1/state")])


@given(WRONG_AUTH, ROUTES, st.one_of(hostile_orders().map(lambda d: json.dumps(d).encode()), st.binary(max_size=50)))
def test_without_the_token_it_is_a_401_and_nothing_is_taken(agent: tuple[TestClient, HarmlessAgent],
                                                            header: bytes | None, route: tuple[str, str],
                                                            body: bytes) -> None:
    client, node = agent
    before = node.submitted
    headers = {"Content-Type": "application/json", **({"Authorization": header} if header is not None else {})}
    r = client.request(route[0], route[1], content=body if route[0] == "POST" else None, headers=headers)
    assert r.status_code == 401, (header, r.status_code, r.text[:200])
    _refusal(r)
    assert node.submitted == before


@given(st.sampled_from(["Bearer", "bearer", "BEARER", "bEaReR"]), st.sampled_from(["", " ", "  \t"]))
def test_the_token_is_taken_whatever_the_case_of_its_scheme(agent: tuple[TestClient, HarmlessAgent], scheme: str,
                                                            pad: str) -> None:
    client, _ = agent
    r = client.get("/v1/state", headers={"Authorization": f"{scheme} {pad}{TOKEN}{pad}"})
    assert r.status_code == 200 and r.json()["node"] == "n1", r.text[:200]


ORDER_IDS = st.one_of(TEXT, st.sampled_from(["kill-3", "a/b", "a/..", "..", ".", "%00", "%2F", "x" * 5000, "id\n"]))


@given(ORDER_IDS, st.sampled_from([lambda t: quote(t, safe=""), lambda t: quote(t, safe="/"),
                                   lambda t: quote(quote(t, safe=""), safe="")]))
def test_any_order_id_is_answered_or_refused_never_a_server_error(agent: tuple[TestClient, HarmlessAgent],
                                                                  order_id: str, encode: Any) -> None:
    client, _ = agent
    r = client.get(f"/v1/orders/{encode(order_id)}", headers=AUTH)
    # NOTE: 405 too: the client resolves a '.' or '..' segment, and "/v1/orders/." is POST /v1/orders' path.
    assert r.status_code in (200, 404, 405), (order_id, r.status_code, r.text[:200])
    if r.status_code == 200:
        assert isinstance(r.json(), dict), r.text[:200]
    else:
        _refusal(r)


@given(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
       st.one_of(st.sampled_from(["/", "/v1", "/v1/orders", "/v1/orders/", "/v1/state", "/v1/state/x", "/healthz/x",
                                  "/metrics", "/v1/orders/kill-3/cancel"]), TEXT.map(lambda t: "/" + quote(t))),
       st.booleans())
def test_any_method_and_path_is_answered_in_json_never_a_server_error(agent: tuple[TestClient, HarmlessAgent],
                                                                      method: str, path: str, token: bool) -> None:
    client, _ = agent
    if path == "/healthz":
        return  # NOTE: 503 while one of its threads is not running: here the poller, never started
    r = client.request(method, path, headers=AUTH if token else {})
    assert r.status_code < 500, (method, path, r.status_code, r.text[:200])
    if r.status_code >= 400:
        _refusal(r)
