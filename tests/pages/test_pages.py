"""The pages without a browser: the heat map and the costs computed from a hand-written run, the served pages'
policy, escaping and token, and the single-file report. In process, a second or two in all."""

from __future__ import annotations

import base64
import hashlib
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.applications import Starlette

pytestmark = pytest.mark.unit

with warnings.catch_warnings():
    # NOTE: Starlette 1.x suggests httpx2 for its TestClient; httpx still works and is what dev installs.
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from starlette.testclient import TestClient

from healer.engine.engine import Healer
from healer.incidents.db import ensure_schema
from healer.ledger.goodput import Interval
from healer.pages import heatmap
from healer.pages.cost import incident_costs
from healer.pages.onefile import write_report
from healer.pages.rundir import RunDir, find_run_dir
from healer.pages.views import Sources
from healer.service.health import Readiness
from healer.service.pages import page_routes
from tests.healer.helpers import make_healer
from tests.healer.services import TOKEN
from tests.pages.synthetic import HOSTILE, JOB, SLOW_RANK, T0, write_incidents, write_run


@pytest.fixture
def healer(tmp_path: Path) -> Healer:
    return make_healer(tmp_path, "- name: xid\n  when: {alert: GpuXid}\n")


@pytest.fixture
def served(tmp_path: Path, healer: Healer) -> Iterator[tuple[TestClient, int, int]]:
    write_run(tmp_path / "runs")
    straggler, hostile = write_incidents(str(healer.store.engine.url))
    readiness = Readiness(lambda: ensure_schema(healer.store.engine))
    readiness.probe()
    sources = Sources(engine=healer.store.engine, run_roots=(tmp_path / "runs",))
    app = Starlette(routes=page_routes(healer, readiness, TOKEN, sources))
    with TestClient(app, raise_server_exceptions=True) as client:
        yield client, straggler, hostile


def test_it_marks_the_suspect_rank_whose_compute_stands_out_in_the_heat_map(tmp_path: Path) -> None:
    run = RunDir(write_run(tmp_path))
    heat = heatmap.build(run, run.attempts()[0], T0 + 15, [SLOW_RANK])
    assert heat is not None
    rows = {r.rank: r for r in heat.rows}
    assert [r for r in rows.values() if r.suspect] == [rows[SLOW_RANK]]
    assert (rows[SLOW_RANK].node, rows[SLOW_RANK].stage, rows[0].node) == ("n2", 1, "n1")  # the journal's hosts
    assert rows[SLOW_RANK].worst == pytest.approx(3.0) and all(rows[r].worst == pytest.approx(1.0) for r in (0, 1, 3))
    slow = [c for c in heat.cells if c.y == rows[SLOW_RANK].y and c.ratio == pytest.approx(3.0)]
    assert slow and {c.fill for c in slow} <= {heatmap.STOPS[-2][1], heatmap.STOPS[-1][1]}  # the darkest two


def test_it_charges_an_incident_its_ledger_seconds_and_the_startup_of_the_attempt_it_restarted() -> None:
    spans = [Interval("productive", 0, 10), Interval("detection", 10, 12, 1), Interval("diagnosis", 12, 15, 1),
             Interval("restart", 15, 16, 1), Interval("startup", 16, 26), Interval("lost", 26, 30, 1, 4),
             Interval("productive", 30, 40), Interval("detection", 40, 41, 2)]
    costs = incident_costs(spans, [(1, 16.0)], {1: 4, 2: None})
    assert costs[1].seconds == {"detection": 2, "diagnosis": 3, "restart": 1, "lost": 4, "startup": 10}
    assert costs[1].gpu_seconds == 4 * 20
    assert costs[2].total_s == 1 and costs[2].gpu_seconds is None  # rank count unknown: no GPU-time made up
    assert (costs[1].until, costs[2].until, costs[1].ledger_s) == (30.0, 41.0, 20.0)  # when each was over


def test_it_never_looks_for_a_run_directory_outside_its_roots(tmp_path: Path) -> None:
    write_run(tmp_path / "runs")
    assert find_run_dir([tmp_path / "runs"], JOB) is not None
    for name in ("..", f"../runs/{JOB}", f"{JOB}/", "/etc", f"runs/{JOB}", ""):
        assert find_run_dir([tmp_path / "runs", tmp_path], name) is None


def test_it_serves_pages_that_allow_no_script_and_only_their_own_stylesheet(served: tuple[TestClient, int, int]
                                                                            ) -> None:
    client, straggler, _ = served
    for path in ("/incidents", f"/incidents/{straggler}", f"/jobs/{JOB}", "/incidents?state=open&job=synth"):
        r = client.get(path)
        assert r.status_code == 200, path
        policy = r.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src" not in policy and "unsafe" not in policy
        (css,) = re.findall(r"<style>(.*?)</style>", r.text, re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(css.encode()).digest()).decode()
        assert f"style-src 'sha256-{digest}'" in policy
        assert "<script" not in r.text and " style=" not in r.text
    page = client.get(f"/incidents/{straggler}").text
    assert 'class="row suspect" data-rank="2" data-node="n2"' in page
    trace = client.get(f"/jobs/{JOB}/trace.json")
    assert trace.json()["otherData"]["ranks"] == 4 and "attachment" in trace.headers["content-disposition"]
    assert client.get("/jobs/unknown/trace.json").status_code == 404
    # Digits that are not ASCII ones are no incident's number: a 404, not a 500.
    for path in ("/incidents/%C2%B2", "/incidents/%D9%A3", "/incidents?offset=%C2%B2"):
        assert client.get(path).status_code in (400, 404), path


def test_it_shows_every_hostile_value_as_text(served: tuple[TestClient, int, int]) -> None:
    client, _, hostile = served
    for path in ("/incidents", f"/incidents/{hostile}", f"/incidents?job={HOSTILE}"):
        page = client.get(path).text
        assert HOSTILE not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page, path
    # A job name is a URL path segment in links: quoted, never a path of its own.
    assert "/jobs/%3Cscript%3Ealert%281%29%3C%2Fscript%3E" in client.get("/incidents").text


def test_it_acts_on_an_incident_only_with_the_token(served: tuple[TestClient, int, int], healer: Healer) -> None:
    client, _, hostile = served
    form = {"by": "oncall", "note": "looking", "token": "wrong"}
    assert client.post(f"/incidents/{hostile}/ack", data=form).status_code == 401
    assert client.post(f"/incidents/{hostile}/ack", data={**form, "token": ""}).status_code == 401
    assert healer.store.state_of(hostile).value == "open"
    # What the API refuses, the form does too: a control character, a direction override, a name not printable.
    for bad in ({"note": "fixed\x07"}, {"note": "\u202edenif"}, {"by": "on\u2066call"}):
        r = client.post(f"/incidents/{hostile}/ack", data={**form, "token": TOKEN, **bad})
        assert r.status_code == 400, bad
    assert healer.store.state_of(hostile).value == "open"
    r = client.post(f"/incidents/{hostile}/ack", data={**form, "token": TOKEN}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/incidents/{hostile}"
    assert healer.store.get(hostile)["acknowledged_by"] == "person:oncall"
    assert client.post(f"/incidents/{hostile}/explode", data={**form, "token": TOKEN}).status_code == 404
    assert client.get("/incidents/99999").status_code == 404 and client.get("/incidents?state=bogus").status_code == 400


def test_it_writes_a_report_that_is_one_file_and_may_load_nothing(tmp_path: Path) -> None:
    run = write_run(tmp_path)
    db_url = f"sqlite:///{tmp_path / 'healer.db'}"
    write_incidents(db_url)
    from healer.incidents.db import make_engine

    engine = make_engine(db_url)
    page = write_report(run, engine, JOB, tmp_path / "report.html").read_text()
    engine.dispose()
    assert '<meta http-equiv="Content-Security-Policy" content="default-src &#39;none&#39;;' in page
    assert not re.search(r"\s(src|srcset|action)=", page)  # nothing to fetch, nowhere to post
    hrefs = set(re.findall(r'href="([^"]*)"', page))
    assert all(h.startswith("#") or h == "data:," for h in hrefs), hrefs  # anchors within the file, the blank icon
    assert 'id="incident-1"' in page and 'class="waterfall"' in page and 'class="row suspect" data-rank="2"' in page


def test_the_report_shows_each_host_with_its_role_and_its_slurm_state_at_the_end(tmp_path: Path) -> None:
    run = write_run(tmp_path)
    (run / "supervisor" / "hosts.json").write_text('{"n1": {"state": "IDLE", "reason": null}, '
                                                   '"n2": {"state": "IDLE+DRAIN", "reason": "megaheal: incident 1"}}')
    db_url = f"sqlite:///{tmp_path / 'healer.db'}"
    write_incidents(db_url)
    from healer.incidents.db import make_engine

    engine = make_engine(db_url)
    page = write_report(run, engine, JOB, tmp_path / "report.html").read_text()
    engine.dispose()
    table = page[page.index('<table class="hosts">'):]
    table = table[:table.index("</table>")]
    assert "<td>n1</td>" in table and "0: trained" in table and "IDLE+DRAIN (megaheal: incident 1)" in table


def test_a_database_that_is_down_is_said_without_naming_its_host_user_or_database(healer: Healer) -> None:
    from healer.incidents.db import make_engine

    down = make_engine("postgresql+psycopg://secret_user@127.0.0.1:1/secret_db")
    readiness = Readiness(lambda: ensure_schema(down))
    readiness.probe()
    assert "secret_user" in readiness.reason or "127.0.0.1" in readiness.reason  # what must not reach a visitor
    app = Starlette(routes=page_routes(healer, readiness, TOKEN, Sources(engine=down, run_roots=())))
    with TestClient(app, raise_server_exceptions=True) as client:
        for path in ("/incidents", "/incidents/1", f"/jobs/{JOB}"):
            page = client.get(path)
            assert page.status_code == 503 and "database unavailable" in page.text, path
            assert not any(word in page.text for word in ("secret_user", "secret_db", "127.0.0.1")), page.text


@pytest.mark.parametrize("ledgered", [False, True])
def test_an_incident_page_shows_what_the_reports_whole_ledger_gives_it(tmp_path: Path, ledgered: bool) -> None:
    """Served, an incident's page reads its own timeline (with its stage lengths from the run directory) and its cost
    from the database's ledger where `megaheal run` wrote one; else the whole ledger of the run directory."""
    from healer.incidents.db import make_engine
    from healer.ledger.store import LedgerWriter
    from healer.pages.views import incident_ledger, incident_view, job_ledger

    run = write_run(tmp_path / "runs")
    db_url = f"sqlite:///{tmp_path / 'healer.db'}"
    straggler, _ = write_incidents(db_url)
    engine = make_engine(db_url)
    if ledgered:
        assert LedgerWriter(run, engine, JOB).write() > 0
    src = Sources(engine=engine, run_roots=(tmp_path / "runs",))
    view = incident_view(src, straggler)
    assert view == incident_view(src, straggler, job_ledger(src, JOB))
    assert incident_ledger(src, JOB, straggler).whole is not ledgered  # the database's ledger: this incident's alone
    assert view.timeline is not None and view.timeline["detected_in_s"] is not None
    assert view.cost is not None and view.cost.ranks == 4 and view.heat is not None and view.has_run
    engine.dispose()


def test_a_served_straggler_page_leads_with_its_story_and_counts_its_slowdown_in_the_list_too(
        served: tuple[TestClient, int, int]) -> None:
    client, straggler, _ = served
    page = client.get(f"/incidents/{straggler}").text
    story = page[page.index('<p class="story">'):]
    assert story.startswith('<p class="story">Rank 2 on n2 held the job up in job synth (attempt 0)')
    assert page.index('<p class="story">') < page.index('<dl class="facts">')  # the words come before the tables
    (cost,) = re.findall(r'<dd class="cost">(\d+) GPU-s', page)
    assert int(cost) > 0  # the steps it slowed, on every rank: not 0
    listed = client.get("/incidents").text
    row = listed[listed.index(f'<tr data-incident="{straggler}">'):]
    assert f">{cost} GPU-s</td>" in row[:row.index("</tr>")]


def test_the_report_shows_the_job_and_each_incident_against_the_objective_the_run_recorded(tmp_path: Path) -> None:
    from datetime import timedelta

    from healer.incidents.db import make_engine
    from healer.ledger.metrics import GoodputCollector
    from healer.ledger.objective import write_objective

    run = write_run(tmp_path)
    write_objective(run, GoodputCollector.Config(ettr_target=0.8, ettr_window=timedelta(days=1)))
    db_url = f"sqlite:///{tmp_path / 'healer.db'}"
    write_incidents(db_url)
    engine = make_engine(db_url)
    page = write_report(run, engine, JOB, tmp_path / "report.html").read_text()
    engine.dispose()
    # The job at the end of its ledger: 19.9 s of 23 s productive (the first 3.1 s are the attempt's startup).
    job = page[page.index("<h2>Against its objective</h2>"):page.index("<h2>Where the time went</h2>")]
    assert ("ETTR 86.5% over the run&#39;s 23.0 s (shorter than the window), against an objective of 80.0% over 1d: "
            "<b>met by 6.5 points</b>. Error budget 20.0% (4.6 s): 3.1 s not productive, 67% of it spent.") in job
    assert '<table class="burn">' in job and "<tr><td>1h</td><td class=\"num\">0</td>" in job
    assert "Losses, largest first: startup 3.1 s (13.5%)." in job and "the default" not in job
    # The straggler when it was detected (it cost no second of downtime: the job trained through it).
    (line,) = re.findall(r"<dt>the job's ETTR</dt><dd class=\"objective\">(.*?)</dd>", page)
    assert line == ("79.3% at the time (the run so far), against 80.0% over 1d: missed by 0.7 points; burn rate 0 "
                    "over the last 1h; this incident: 0.0 s of the 3.1 s the job did not train (0%), its slowdown "
                    "aside (the job trained)")


def test_a_served_page_without_the_run_directory_judges_the_job_against_the_default_objective(
        tmp_path: Path) -> None:
    from healer.incidents.db import make_engine
    from healer.ledger.store import LedgerWriter
    from healer.pages import render
    from healer.pages.views import incident_view, job_ledger, job_view

    run = write_run(tmp_path / "runs")
    db_url = f"sqlite:///{tmp_path / 'healer.db'}"
    straggler, _ = write_incidents(db_url)
    engine = make_engine(db_url)
    assert LedgerWriter(run, engine, JOB).write() > 0
    src = Sources(engine=engine)  # no run_roots: the database's ledger alone
    view = incident_view(src, straggler)
    assert view == incident_view(src, straggler, job_ledger(src, JOB))
    assert view.standing is not None and view.standing.objective.source == "default"
    assert "against 95.0% over 7d (the default): missed by 15.7 points" in render.incident_page(view)
    page = render.job_page(job_view(src, JOB))
    assert "missed by 8.5 points" in page
    assert "Objective: the default: the job&#39;s run directory, where megaheal run records" in page
    engine.dispose()
