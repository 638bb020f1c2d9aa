"""Fuzz: the healer's pages (healer/service/pages.py, rendered by healer/pages/) in process, mounted beside the API as
the service mounts them, on SQLite holding a hand-written run's incidents and a hostile one (tests/pages/synthetic.py).
Whatever the path, query or form: never a 5xx; markup in the input never comes back as markup; a 400 of the list
names the parameter; the ack and resolve forms act only with the token and only on what the API's own rule
(healer/service/requests.py `check_person`) takes."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.unit

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from starlette.testclient import TestClient

from healer.engine.engine import Healer
from healer.incidents.db import ensure_schema
from healer.pages.views import Sources
from healer.service.api import create_app
from healer.service.health import Readiness
from healer.service.pages import page_routes
from healer.service.requests import Refused, check_person
from tests.fuzz.json_strategies import NASTY_TEXT, TEXT
from tests.healer.helpers import make_healer
from tests.healer.services import TOKEN
from tests.pages.synthetic import JOB, write_incidents, write_run

MARKUP = ["<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "<iframe src=javascript:alert(1)>",
          "\"><script>alert(2)</script>", "'><img src=x>", "<ScRiPt>alert(3)</ScRiPt>"]
"""What must never come back unescaped: the pages have no script, image or frame of their own."""
TAGS = ("<script", "<img", "<iframe")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Healer, list[int]]]:
    tmp: Path = tmp_path_factory.mktemp("pages")
    healer = make_healer(tmp, "- name: xid\n  when: {alert: GpuXid}\n")
    write_run(tmp / "runs")
    ids = list(write_incidents(str(healer.store.engine.url)))
    readiness = Readiness(lambda: ensure_schema(healer.store.engine))
    readiness.probe()
    app = create_app(healer, readiness, TOKEN)
    app.router.routes.extend(page_routes(healer, readiness, TOKEN, Sources(engine=healer.store.engine,
                                                                           run_roots=(tmp / "runs",))))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, healer, ids


def _check(r: Any) -> str:
    """The body, after checking the answer is no server error and reflects no markup."""
    assert r.status_code < 500, (r.request.url, r.status_code, r.text[:300])
    lowered = r.text.lower()
    assert not any(tag in lowered for tag in TAGS), (r.request.url, r.text[:300])
    return r.text


# Text with markup somewhere in it, as a path segment or a value; percent-encoded in several ways, or raw.
WITH_MARKUP = st.tuples(TEXT, st.sampled_from(MARKUP), TEXT).map("".join)
VALUES = st.one_of(TEXT, WITH_MARKUP, st.sampled_from([JOB, "synth", "open", "resolved", "straggler", "crash", "n2",
                                                       "0", "100", "-1", "1e3", "²", "٣", "9" * 30, "x" * 300]))
ENCODINGS = st.sampled_from([lambda t: quote(t, safe=""), lambda t: quote(t, safe="/"),
                             lambda t: quote(quote(t, safe=""), safe=""),
                             lambda t: quote(t, safe="/<>\"'=()!$&*+,;:@")])
SEGMENTS = st.one_of(VALUES, st.integers(-5, 2**70).map(str), NASTY_TEXT)


@given(st.sampled_from(["/incidents/{}", "/jobs/{}", "/jobs/{}/trace.json", "/incidents/{}/x", "/{}", "/jobs/{}/",
                        "/incidents/{}/"]), SEGMENTS, ENCODINGS)
def test_any_page_path_is_answered_never_a_server_error_and_never_reflects_markup(
        served: tuple[TestClient, Healer, list[int]], template: str, segment: str, encode: Any) -> None:
    client, _, _ = served
    _check(client.get(template.format(encode(segment))))


QUERY_KEYS = st.one_of(st.sampled_from(["job", "state", "kind", "node", "offset"]), TEXT, WITH_MARKUP)


@given(st.lists(st.tuples(QUERY_KEYS, VALUES), max_size=5), st.booleans())
def test_a_query_of_the_list_is_answered_and_a_400_names_the_parameter(served: tuple[TestClient, Healer, list[int]],
                                                                       params: list[tuple[str, str]],
                                                                       encoded: bool) -> None:
    client, _, _ = served
    query = urlencode(params) if encoded else "&".join(f"{quote(k, safe='<>')}={quote(v, safe='<>')}"
                                                       for k, v in params)
    r = client.get(f"/incidents?{query}")
    body = _check(r)
    assert r.status_code in (200, 400), (query, r.status_code)
    if r.status_code == 400:
        (message,) = re.findall(r'<p class="summary">(.*?)</p>', body, re.DOTALL)
        assert re.match(r"(job|state|kind|node|offset)\b", message), message


BY = st.one_of(st.sampled_from(["oncall", " oncall ", "Zoë", "a" * 128]), VALUES,
               st.sampled_from(["a" * 129, "on\u2066call", "on\ncall", "\u00a0", ""]))
NOTE = st.one_of(VALUES, st.sampled_from(["", "fixed\x07", "\u202edenif", "a\tb\nc\r", "n" * 4001]))
TOKENS = st.one_of(st.just(TOKEN), st.sampled_from([TOKEN + " ", TOKEN.upper(), TOKEN[:-1], ""]), TEXT)
FORMS = st.one_of(st.fixed_dictionaries({"by": BY, "token": TOKENS}, optional={"note": NOTE}),
                  st.fixed_dictionaries({}, optional={"by": BY, "note": NOTE, "token": TOKENS, "extra": VALUES}))


@given(st.sampled_from(["ack", "resolve", "ack", "resolve", "x", "ACK"]), st.sampled_from([0, 1, 1, 99999]), FORMS,
       st.sampled_from(["application/x-www-form-urlencoded", "application/x-www-form-urlencoded",
                        "application/x-www-form-urlencoded; charset=utf-8", "multipart/form-data", "text/plain", ""]))
def test_the_ack_and_resolve_forms_act_only_with_the_token_and_a_person_the_api_would_take(
        served: tuple[TestClient, Healer, list[int]], verb: str, which: int, form: dict[str, str],
        content_type: str) -> None:
    client, healer, ids = served
    incident = ids[which] if which < len(ids) else which
    before = healer.store.get(incident)["events"] if which < len(ids) else None
    r = client.post(f"/incidents/{incident}/{verb}", content=urlencode(form).encode(),
                    headers={"Content-Type": content_type} if content_type else {}, follow_redirects=False)
    _check(r)
    try:
        check_person(form.get("by", "").strip(), form.get("note", ""))
        person_ok = True
    except Refused:
        person_ok = False
    form_ok = content_type.startswith("application/x-www-form-urlencoded")
    acts = verb in ("ack", "resolve") and which < len(ids) and form_ok and form.get("token") == TOKEN and person_ok
    if r.status_code == 303:
        assert acts and r.headers["location"] == f"/incidents/{incident}"
    else:
        assert r.status_code in (400, 401, 404, 409, 413, 415), (r.status_code, r.text[-300:])
        assert not acts or r.status_code == 409, (form, r.status_code)  # 409: no such move from its state now
        if before is not None:
            assert healer.store.get(incident)["events"] == before, "a refused form changed the incident"
    if r.status_code == 400:
        assert verb in ("ack", "resolve") and form.get("token") == TOKEN and not person_ok
