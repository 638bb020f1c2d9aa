"""What the pages say in words and how they lay out: the headline and the decision's sentences built from an
incident's timeline and basis, the hang's chain of waits, a slowdown's cost from step records, and chart labels that
never overlap. Pure functions over hand-written payloads, and the pages rendered from tests/pages/synthetic.py. In
process, about a second."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from healer.detect.hang_attribution import attribute
from healer.pages.axes import label_width, place_labels
from healer.pages.cost import slowdown
from healer.pages.evidence import wait_chain
from healer.pages.story import decision_sentences, headline, lost_steps, status_said
from healer.pages.views import stage_list
from healer.pages.waterfall import markers
from tests.pages.synthetic import JOB, MESH, SLOWED_S, hang_ranks

pytestmark = pytest.mark.unit


def _incident(kind: str, state: str, page: str = "on-escalation", events: list[dict[str, Any]] | None = None
              ) -> dict[str, Any]:
    return {"id": 7, "kind": kind, "state": state, "page": page, "job": "j", "summary": "s", "events": events or [],
            "acknowledged_by": None}


def _timeline(**kw: Any) -> dict[str, Any]:
    base = {"id": 7, "kind": "crash", "attempt": 0, "detected_at": 100.0, "stages": ["detected"], "action": None,
            "plan": None, "resume_step": None, "restart_mode": None, "recovered_at": None, "remediated_at": None,
            "first_step_after": None, "lost_steps": None, "state": "open"}
    return base | kw


def test_the_headline_says_who_was_left_out_how_the_job_restarted_and_that_nobody_was_paged() -> None:
    plan = {"remedy": "exclude-node-and-restart", "exclude": ["n2"], "nodes": ["n1", "n3"], "dp": 2,
            "decision_basis": {"lemons": {"n2": 3}}}
    t = _timeline(stages=["detected", "diagnosed", "decided", "restarted", "recovered"], action=plan["remedy"],
                  plan=plan, resume_step=8, restart_mode="cold", remediated_at=130.0, recovered_at=152.0,
                  first_step_after=9, lost_steps=0)
    said = headline(_incident("crash", "resolved"), t, [{"started_at": "x", "outcome": None}], [3], ["n2"])
    assert said == ("Rank 3 on n2 crashed in job j (attempt 0): megaheal stopped the job, left n2 out as a lemon and "
                    "restarted it cold from step 8 on n1 and n3; nobody was paged: it did not escalate. It trained "
                    "again at step 9, 52.0 s after detection (no steps lost).")


def test_the_headline_says_an_escalation_stopped_the_job_and_paged_on_call() -> None:
    events = [{"kind": "transition", "evidence": {"decision": {"stop_job": True, "basis": {"reason": "r"}}}}]
    t = _timeline(stages=["detected", "decided", "escalated"], action="escalate", plan={"remedy": "escalate"})
    said = headline(_incident("hang", "escalated", events=events), t, [], [2], ["n2"])
    assert "megaheal stopped the job and escalated to a person; on-call was paged: it escalated." in said
    notified = headline(_incident("straggler", "remediating", page="never"),
                        _timeline(kind="straggler", action="notify", plan={"remedy": "notify"}), [], [2], ["n2"])
    down = headline(_incident("node_down", "open") | {"job": None}, None, [], [], ["n5"])
    assert down == "n5 went down: megaheal has not acted on it yet; nobody was paged: it did not escalate. It is open."
    told = headline(_incident("node_down", "remediating") | {"job": None}, None, [], [], ["n5"], [{"action": "notify"}])
    assert told.startswith("n5 went down: megaheal notified on-call; nobody was paged")
    assert notified.startswith("Rank 2 on n2 held the job up in job j (attempt 0): megaheal notified on-call and left "
                               "the job running; nobody was paged (its rule never pages).")


def test_the_decision_is_said_in_sentences_with_its_numbers_and_unknown_keys_are_kept() -> None:
    basis = {"rule": "crash", "remediate": "restart (catalogue)", "runbook": "node-health", "kind": "crash",
             "verdict": "fail", "verdict_bad_nodes": ["n2"], "lemons": {"n4": 3}, "lemon_incidents": 3,
             "lemon_window_s": 3600.0, "remedy_from": "a host proven bad", "restarts_in_window": 1, "max_restarts": 5,
             "window_s": 3600.0, "restart": {"mode": "cold", "why": "the hosts or the layout change"},
             "reason": "exclude n2, n4; replace with spare(s) n5, n6", "brand_new": {"a": 1}}
    sentences, rest = decision_sentences({"remedy": "exclude-node-and-restart", "decision_basis": basis,
                                          "exclude": ["n2", "n4"], "nodes": ["n1", "n5", "n6"], "dp": 3})
    text = " ".join(sentences)
    assert "Diagnosis: runbook node-health said fail; it failed n2." in text
    assert "n4 was left out as a lemon: it was named in 3 incidents within the last hour (lemon threshold 3)." in text
    assert "Restart budget: 1 restart in the last hour before this one, of at most 5." in text
    assert "The restart is cold: the hosts or the layout change." in text and "Left out: n2 and n4." in text
    assert not re.search(r"[A-Z]{2,}_[A-Z]", text) and "window_s" not in text  # no internal keys in the sentences
    assert rest == [("brand_new", {"a": 1})]
    scaled = basis | {"max_restarts": 30, "budget_scale": {"restarts": 5, "per_hosts": 2048, "hosts": 12288}}
    sentences, _ = decision_sentences({"remedy": "restart", "decision_basis": scaled})
    assert "of at most 30 (5 for each 2,048 hosts; the job has 12,288)." in " ".join(sentences)
    swap = {"rule": "straggler", "kind": "straggler", "fail_slow": {
        "swap": True, "reason": "fail-slow: 0.500 s a step x 979 steps left = 490 s, more than a swap's 120 s",
        "steps_left_from": "the job's 1000 steps, named at step 20", "swap_cost_from": "swap_cost: no restart yet"}}
    text = " ".join(decision_sentences({"remedy": "exclude-node-and-restart", "decision_basis": swap})[0])
    assert ("Swap or bear: fail-slow: 0.500 s a step x 979 steps left = 490 s, more than a swap's 120 s (steps left "
            "from the job's 1000 steps, named at step 20; the swap's cost swap_cost: no restart yet).") in text


def test_no_page_text_says_none_steps_or_a_status_twice() -> None:
    assert lost_steps(None) == "steps lost: unknown" and lost_steps(0) == "no steps lost" and lost_steps(1) == "1 step lost"
    assert status_said("n1: pass: pass: 3 step(s) passed") == "n1: pass: 3 step(s) passed"
    stages = stage_list(_timeline(recovered_at=140.0, first_step_after=None, lost_steps=None, detected_in_s=1.0,
                                  remediated_at=120.0))
    assert all("None" not in what for _, _, what in stages), stages
    assert ("restarted", 20.0, "from the newest checkpoint") in stages


@dataclass(frozen=True)
class _Rec:
    step: int
    time: float
    step_seconds: float


def test_a_slowdown_costs_what_it_added_to_each_step_from_where_the_windows_began() -> None:
    records = [_Rec(s, 10.0 + s, 1.0 if s < 10 else 1.5) for s in range(30)]
    found = slowdown(records, {"detected_at": 22.5, "resolved_at": 35.5,
                               "evidence": {"windows": 2, "window_steps": 3}}, ended_at=40.0)
    # Detected after step 12 (time 22): the windows began 6 steps earlier, at step 7; it lasted to step 25.
    assert found is not None and (found.first_step, found.last_step, found.steps) == (7, 25, 19)
    assert found.baseline_s == 1.0 and found.excess_s == pytest.approx(0.5 * 16)
    assert slowdown(records[:1], {"detected_at": 10.5, "evidence": {}}, None) is None  # nothing before it
    # Named before the windows' worth of its own steps ran slow (a loaded machine): its windows reach back to the
    # attempt's start, and the faster half of the steps until then is the pace before.
    early = [_Rec(s, 10.0 + s, 1.0 if s < 5 else 2.0) for s in range(12)]
    found = slowdown(early, {"detected_at": 16.5, "evidence": {"windows": 2, "window_steps": 3}}, ended_at=30.0)
    assert found is not None and found.baseline_s == 1.0 and found.excess_s == pytest.approx(1.0 * 7), found


def test_the_chain_of_waits_ends_at_the_rank_that_holds_everyone_up() -> None:
    att = attribute(hang_ranks(), MESH)
    chain = wait_chain({int(r): w for r, w in att.to_payload()["waits"].items()}, att.suspects)
    culprit = [b for b in chain.boxes if b.culprit]
    assert [b.text for b in culprit] == ["rank 2"] and culprit[0].what == "not in a collective"
    assert culprit[0].x == max(b.x for b in chain.boxes)  # the end of every chain, rightmost
    assert len(chain.arrows) == 3 and all(a.x2 > a.x1 for a in chain.arrows)  # each waiter points right, at whom
    assert "rank 1 waits in dp_reduce (dp) for rank(s) 0" in chain.sentences


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("seed", range(5))
def test_no_two_labels_of_a_row_overlap(seed: int) -> None:
    rng = random.Random(seed)
    labels = [(rng.uniform(0, 700), f"#{rng.randint(1, 999)} {rng.choice(['crash', 'straggler', 'hang'])}")
              for _ in range(40)]
    rows = place_labels(labels, 3)
    boxes: dict[int, list[tuple[float, float]]] = {}
    for (x, text), row in zip(labels, rows, strict=True):
        if row is not None:
            boxes.setdefault(row, []).append((x, x + label_width(text)))
    for row in boxes.values():
        assert not any(_overlap(a, b) for i, a in enumerate(row) for b in row[i + 1:]), row
    assert rows.count(None) < len(labels) and set(boxes) <= {0, 1, 2}
    # Two labels far apart share the first row; two close together take a row each.
    assert place_labels([(0.0, "#1 crash"), (300.0, "#2 crash")], 2) == [0, 0]
    assert place_labels([(0.0, "#1 crash"), (5.0, "#2 crash"), (9.0, "#3 hang")], 2) == [0, 1, None]
    assert [m.row for m in markers([(5.0, 2, "#2 hang"), (0.0, 1, "#1 crash")], 2)] == [1, 0]


def test_the_pages_draw_the_evidence_and_count_the_stragglers_slowdown(tmp_path: Path) -> None:
    from healer.incidents.db import make_engine
    from healer.pages.onefile import write_report
    from tests.pages.synthetic import write_hang, write_incidents, write_run

    run = write_run(tmp_path)
    db_url = f"sqlite:///{tmp_path / 'healer.db'}"
    write_incidents(db_url)
    hang = write_hang(db_url)
    engine = make_engine(db_url)
    page = write_report(run, engine, JOB, tmp_path / "report.html").read_text()
    engine.dispose()
    section = page[page.index(f'id="incident-{hang}"'):]
    assert '<svg class="waits"' in section and '<table class="stackgroups">' in section
    assert '<g class="wait culprit">' in section and "not in a collective" in section
    assert '<p class="story">Rank 2 on n2 hung in job synth (attempt 0): megaheal has not acted on it yet' in section
    straggler = page[page.index('id="incident-1"'):page.index(f'id="incident-{hang}"')]
    assert '<th class="grew">compute ▲</th>' in straggler
    # Detected after step 11; its 2 windows of 3 steps began at step 6; every step from 5 on took SLOWED_S more.
    assert f"took {14 * SLOWED_S:.1f} s more than the median step before them" in straggler
    assert f'class="cost">{14 * SLOWED_S * 4:.0f} GPU-s (4 ranks x' in straggler
    assert "megaheal incidents show 1" in page and f"megaheal timeline {run} -o trace.json" in page
    assert "None step" not in page and "pass: pass:" not in page
