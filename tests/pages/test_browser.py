"""The healer's pages in a real browser, after a real self-healing run (tests/selfheal/straggler_crash_run.py: 2 nodes x
2 ranks healed by the embedded healer through a straggler and a crash, shared with test_e2e.py), then a real `megaheal
healer` process serving a copy of that run's database with a hostile incident added, and headless Chromium
(tests/pages/conftest.py) reading its pages and the run's single-file report. Screenshots under the pytest tmp dir
(printed at the end of the session)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from healer.runner.report import write_html
from tests.conftest import REPO
from tests.healer.services import TOKEN
from tests.pages.synthetic import HOSTILE, write_incidents
from tests.selfheal.straggler_crash_run import JOB, HealedRun
from tests.support import free_port, service_ready, wait_for

pytestmark = pytest.mark.e2e


@dataclass(frozen=True, slots=True)
class Healed:
    run_dir: Path
    crash: Any
    straggler: Any
    hostile: int
    report: Path
    count: int
    """The run's incidents."""


@pytest.fixture(scope="module")
def healed(straggler_then_crash: HealedRun, tmp_path_factory: pytest.TempPathFactory) -> Healed:
    run = straggler_then_crash
    # A copy: the hostile incident goes into this module's database, not into the run the other modules check.
    run_dir = tmp_path_factory.mktemp("runs") / JOB
    shutil.copytree(run.run_dir, run_dir)
    # A hostile label, written as a heartbeat or an alert could put it into the store.
    _, hostile = write_incidents(f"sqlite:///{run_dir / 'healer.db'}")
    report = write_html(run_dir, run_dir / "report.html")
    return Healed(run_dir, run.first("crash"), run.first("straggler"), hostile, report, len(run.incidents))


@pytest.fixture(scope="module")
def healer_url(healed: Healed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `megaheal healer` on the run's database, its run directory under `run_roots`."""
    port = free_port()
    config = tmp_path_factory.mktemp("healer") / "healer.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\ndb: sqlite:///{healed.run_dir / 'healer.db'}\n"
                      f"run_roots: [{healed.run_dir.parent}]\n")
    log = open(config.with_name("healer.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "megaheal", "healer", "--config", str(config)], cwd=REPO,
                            env={**os.environ, "MEGAHEAL_TOKEN": TOKEN}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the healer's /readyz", lambda: service_ready(url, proc, "megaheal healer", "/readyz"), 30)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


class Page:
    """A browser tab that records what a person would not see: console messages, page errors, requests, dialogs."""

    def __init__(self, browser: Any) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.tab = self.context.new_page()
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.tab.on("console", lambda m: self.errors.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
        self.tab.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.tab.on("dialog", lambda d: (self.errors.append(f"dialog: {d.message}"), d.dismiss()))
        self.tab.on("request", lambda r: self.requests.append(r.url))

    def open(self, url: str) -> Any:
        response = self.tab.goto(url)
        assert response is not None and response.ok, (url, response and response.status)
        return self.tab

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = Page(browser)
    try:
        yield p
    finally:
        p.close()


def _suspects(tab: Any) -> str:
    return str(tab.locator("dd.suspects").inner_text())


def _overlapping(tab: Any, selector: str) -> list[tuple[str, str]]:
    """Pairs of the elements at `selector` whose boxes, as the browser laid them out, overlap."""
    # NOTE: text_content, not inner_text: an SVG <text> is no HTMLElement and has no innerText.
    boxes = [(str(e.text_content()), e.bounding_box()) for e in tab.locator(selector).all()]
    return [(a, b) for i, (a, p) in enumerate(boxes) for b, q in boxes[i + 1:]
            if p["x"] < q["x"] + q["width"] and q["x"] < p["x"] + p["width"]
            and p["y"] < q["y"] + q["height"] and q["y"] < p["y"] + p["height"]]


def test_it_lists_the_runs_incidents_with_kind_suspect_and_cost(healer_url: str, healed: Healed, page: Page,
                                                                  shots: Path) -> None:
    tab = page.open(f"{healer_url}/incidents?job={JOB}")
    for inc in (healed.crash, healed.straggler):
        row = tab.locator(f'tr[data-incident="{inc.id}"]')
        assert row.locator("td.kind").inner_text() == inc.kind
        assert f"rank {inc.suspect_ranks[0]}" in row.inner_text() and "n2" in row.inner_text()
    crash_cost = tab.locator(f'tr[data-incident="{healed.crash.id}"] td.num').inner_text()
    assert crash_cost.endswith("GPU-s") and float(crash_cost.split()[0]) > 0
    tab.screenshot(path=str(shots / "incidents.png"), full_page=True)
    assert page.errors == []


def test_it_shows_the_crash_its_suspect_rank_and_node_and_marks_them_in_the_heat_map(
        healer_url: str, healed: Healed, page: Page, shots: Path) -> None:
    tab = page.open(f"{healer_url}/incidents/{healed.crash.id}")
    assert tab.locator("h1 .kind").inner_text() == "crash"
    assert _suspects(tab) == "rank 3, n2"
    suspect = tab.locator("svg.heatmap g.row.suspect")
    assert suspect.count() == 1 and suspect.get_attribute("data-rank") == "3"
    assert suspect.get_attribute("data-node") == "n2" and "suspect" in suspect.text_content()
    assert tab.locator("svg.heatmap rect.cell").count() >= 4 * 8
    assert "recovered" in tab.locator("ol.stages").inner_text()
    story = tab.locator("p.story").inner_text()  # the outcome in words, before any table
    assert story.startswith("Rank 3 on n2 crashed in job") and "restarted it" in story and "paged" in story, story
    assert tab.locator("ul.decision li").count() >= 2 and "None" not in tab.locator("main").inner_text()
    tab.screenshot(path=str(shots / "incident-crash.png"), full_page=True)
    assert page.errors == []


def test_it_shows_the_straggler_computing_slower_than_its_pipeline_stage(healer_url: str, healed: Healed,
                                                                          page: Page, shots: Path) -> None:
    tab = page.open(f"{healer_url}/incidents/{healed.straggler.id}")
    assert tab.locator("h1 .kind").inner_text() == "straggler" and _suspects(tab) == "rank 2, n2"
    rows = tab.locator("svg.heatmap g.row")
    marked = {rows.nth(i).get_attribute("data-rank"): rows.nth(i).get_attribute("class") for i in range(rows.count())}
    assert marked == {"0": "row", "1": "row", "2": "row suspect", "3": "row"}
    # Its stage's other rank (3) computed at the pace of the fastest; rank 2 at well over that.
    ratios = {}
    for rank in (2, 3):
        y = tab.locator(f'svg.heatmap g.row[data-rank="{rank}"] text').get_attribute("y")
        cells = tab.locator("svg.heatmap rect.cell")
        ratios[rank] = sorted(float(r) for r in cells.evaluate_all(
            f"cs => cs.filter(c => Math.abs(+c.getAttribute('y') + 13 - {y}) < 0.5)"
            ".map(c => c.getAttribute('data-ratio')).filter(r => r)"))
    # NOTE: the top third of rank 2's cells, not their median: the window reaches back before the slowdown began (a
    # loaded run detected it after 6 slowed steps of 13 in the window, and its median was a step before it).
    # The straggler rule needs 2 windows of 3 slowed steps, so at least a third of the window is slowed.
    assert ratios[2][2 * len(ratios[2]) // 3] > 1.5 > ratios[3][len(ratios[3]) // 2], ratios
    story = tab.locator("p.story").inner_text()
    assert "notified on-call and left the job running" in story and "nobody was paged" in story, story
    assert tab.locator("table.phases th.grew").text_content().startswith("compute")  # (shown upper case)
    # It slowed every rank: its cost is the time it added to their steps, not 0.
    assert tab.locator("table.cost th", has_text="slowdown").count() == 1
    gpu = tab.locator("table.cost tr.charged td").last.inner_text()
    assert gpu.endswith(("GPU-s", "GPU-h")) and float(gpu.split()[0]) > 0, gpu
    tab.locator("svg.heatmap").screenshot(path=str(shots / "heatmap-straggler.png"))
    tab.screenshot(path=str(shots / "incident-straggler.png"), full_page=True)
    assert page.errors == []


def test_it_shows_a_label_holding_a_script_tag_as_text(healer_url: str, healed: Healed, page: Page,
                                                      shots: Path) -> None:
    tab = page.open(f"{healer_url}/incidents/{healed.hostile}")
    assert tab.locator("p.summary").inner_text() == f"summary {HOSTILE}"
    assert tab.locator("table.labels td").first.inner_text() == HOSTILE
    assert tab.locator("script").count() == 0
    page.open(f"{healer_url}/incidents")
    tab.screenshot(path=str(shots / "incidents-hostile.png"), full_page=True)
    assert page.errors == []  # a script that ran would have opened a dialog; a blocked one logs a CSP error


def test_it_acknowledges_an_incident_from_its_page_only_with_the_token(healer_url: str, healed: Healed,
                                                                       page: Page) -> None:
    tab = page.open(f"{healer_url}/incidents/{healed.hostile}")
    form = tab.locator('form.act[action$="/ack"]')
    form.locator('input[name="by"]').fill("oncall")
    form.locator('input[name="token"]').fill("not-the-token")
    form.locator("button").click()
    assert tab.locator("h1").inner_text() == "401"
    page.errors = [e for e in page.errors if "401" not in e]  # the browser logs the refusal itself
    tab = page.open(f"{healer_url}/incidents/{healed.hostile}")
    form = tab.locator('form.act[action$="/ack"]')
    form.locator('input[name="by"]').fill("oncall")
    form.locator('input[name="token"]').fill(TOKEN)
    form.locator("button").click()
    assert tab.locator("h1 .badge").inner_text() == "acknowledged"
    assert tab.url.endswith(f"/incidents/{healed.hostile}") and page.errors == []


def test_it_shows_the_jobs_goodput_waterfall_loss_and_attempts(healer_url: str, healed: Healed, page: Page,
                                                                shots: Path) -> None:
    tab = page.open(f"{healer_url}/jobs/{JOB}")
    bars = tab.locator("svg.waterfall g.bar")
    assert bars.count() == 8
    assert float(tab.locator('svg.waterfall g.bar[data-category="productive"]').get_attribute("data-seconds")) > 0
    assert tab.locator("svg.lossplot a").count() >= 2  # the incidents, marked at detection
    assert tab.locator("table.attempts tbody tr").count() == 2
    for labels in ("svg.strip text.mark", "svg.lossplot text.mark"):
        assert _overlapping(tab, labels) == [], labels
    tab.screenshot(path=str(shots / "job.png"), full_page=True)
    assert page.errors == []


def test_it_opens_the_run_report_offline_with_no_request_leaving_the_file(healed: Healed, page: Page,
                                                                          shots: Path) -> None:
    page.tab.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                   else route.abort())
    url = healed.report.as_uri()
    tab = page.open(url)
    assert page.requests == [url]
    assert tab.locator("section.incident").count() == healed.count  # every incident of the run, on its own
    assert tab.locator("svg.waterfall").count() == 1 and tab.locator("svg.heatmap g.row.suspect").count() >= 2
    assert tab.locator("ul.stories li").count() == healed.count  # each incident's outcome in one sentence
    commands = tab.locator("table.commands code").all_inner_texts()
    assert f"megaheal report {healed.run_dir}" in commands and f"megaheal timeline {healed.run_dir} -o trace.json" \
        in commands
    tab.screenshot(path=str(shots / "report.png"), full_page=True)
    assert page.errors == []
