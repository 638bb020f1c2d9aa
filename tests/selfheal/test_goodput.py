"""The goodput ledger over a run directory written the way the supervisor and the trainer write it, and incidents
as the healer's store gives them back (healer.incidents.timeline payloads)."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from healer.ledger.goodput import CATEGORIES, KINDS, compute, intervals
from healer.runner.report import report

pytestmark = pytest.mark.unit


def write(path: Path, entries: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))


CRASH = {"id": 1, "kind": "crash", "attempt": 0, "detected_at": 19.0, "decided_at": 19.5, "remediated_at": 21.0,
         "recovered_at": 27.0, "suspect_ranks": [3], "suspect_nodes": ["n2"], "lost_steps": 2, "state": "resolved",
         "action": "restart", "plan": {"decision_basis": {"verdict": None}}, "summary": "rank 3 on n2 killed by SIGKILL"}


def write_crash_run(run_dir: Path) -> None:
    """Attempt 0 starts at 0, first step begins at 10, steps 0..5 take 1 s each (step 3 saves: 0.5 s stall);
    it dies during step 6; detected at 19, decided at 19.5, attempt 1 starts at 21, resumes from the checkpoint
    of step 4 (steps 4, 5 redone), first step begins at 26, steps 4..9 take 1 s each; ends at 33."""
    write(run_dir / "supervisor" / "attempts.jsonl", [
        {"event": "start", "attempt": 0, "at": 0.0}, {"event": "end", "attempt": 0, "at": 20.5},
        {"event": "start", "attempt": 1, "at": 21.0}, {"event": "end", "attempt": 1, "at": 33.0}])
    recs = [{"step": s, "time": 11.0 + s, "step_seconds": 1.0, "phases": {"checkpoint": 0.5 if s == 3 else 0.0}}
            for s in range(6)]
    recs += [{"step": s, "time": 27.0 + (s - 4), "step_seconds": 1.0, "phases": {}} for s in range(4, 10)]
    write(run_dir / "ranks" / "0.jsonl", recs)


def test_it_splits_wall_time_into_productive_checkpoint_lost_detection_restart_and_startup(tmp_path: Path) -> None:
    write_crash_run(tmp_path)
    ledger = compute(tmp_path, [CRASH])
    assert ledger.wall_s == 33.0 and ledger.attempts == 2 and ledger.steps_done == 10 and ledger.lost_steps == 2
    s = ledger.seconds
    assert s["productive"] == pytest.approx(10 - 0.5) and s["checkpointing"] == pytest.approx(0.5)
    assert s["lost_work"] == pytest.approx(2.0) and s["detection"] == pytest.approx(19.0 - 16.0)
    assert s["diagnosis"] == pytest.approx(0.5) and s["restart"] == pytest.approx(1.5)
    assert s["startup"] == pytest.approx(10.0 + 5.0)
    assert sum(s.values()) == pytest.approx(33.0) and ledger.ettr == pytest.approx(9.5 / 33, abs=1e-4)
    (row,) = ledger.incidents
    assert row["detected_in_s"] == pytest.approx(3.0) and row["recovered_in_s"] == pytest.approx(11.0)
    report(tmp_path, [CRASH], quiet=True)
    assert json.loads((tmp_path / "report.json").read_text())["ettr"] == ledger.ettr


def test_an_unsupervised_run_has_no_ledger(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a supervised run"):
        compute(tmp_path, [])
    assert intervals(tmp_path, []) == []


# ---- intervals -----------------------------------------------------------------------------------------------

def test_its_intervals_tile_the_wall_time_in_order_and_sum_to_the_totals(tmp_path: Path) -> None:
    write_crash_run(tmp_path)
    spans = intervals(tmp_path, [CRASH])
    assert (spans[0].start, spans[-1].end) == (0.0, 33.0)
    assert all(a.end == b.start for a, b in pairwise(spans)), "an overlap or a gap"
    assert all(s.end > s.start for s in spans)
    assert all((a.kind, a.incident) != (b.kind, b.incident) for a, b in pairwise(spans)), "not merged"
    totals = compute(tmp_path, [CRASH]).seconds
    for kind, category in zip(KINDS, CATEGORIES):
        assert sum(s.seconds for s in spans if s.kind == kind) == pytest.approx(totals[category]), kind


def test_a_crash_is_told_as_detection_diagnosis_restart_and_lost_work_of_its_incident(tmp_path: Path) -> None:
    write_crash_run(tmp_path)
    assert [(s.kind, s.start, s.end, s.incident, s.steps) for s in intervals(tmp_path, [CRASH])] == [
        ("startup", 0.0, 10.0, None, None), ("productive", 10.0, 13.5, None, 4),
        ("checkpointing", 13.5, 14.0, None, None), ("lost", 14.0, 16.0, 1, 2), ("detection", 16.0, 19.0, 1, None),
        ("diagnosis", 19.0, 19.5, 1, None), ("restart", 19.5, 21.0, 1, None), ("startup", 21.0, 26.0, None, None),
        ("productive", 26.0, 32.0, None, 6), ("other", 32.0, 33.0, None, None)]


def test_a_stretch_of_steps_is_one_interval_split_only_by_a_real_save_or_a_long_pause(tmp_path: Path) -> None:
    # 30 steps of 0.2 s with 1 ms of bookkeeping between them and a 20 us checkpoint check in each; step 9 saves
    # (a 0.1 s stall) and a 2 s pause (an evaluation) comes before step 20.
    recs, t = [], 1.0
    for step in range(30):
        t += 2.0 if step == 20 else 0.0
        recs.append({"step": step, "time": t + 0.2, "step_seconds": 0.2,
                     "phases": {"checkpoint": 0.1 if step == 9 else 2e-5}})
        t += 0.2 + 0.001
    write(tmp_path / "supervisor" / "attempts.jsonl", [{"event": "start", "attempt": 0, "at": 0.0},
                                                       {"event": "end", "attempt": 0, "at": t + 0.5}])
    write(tmp_path / "ranks" / "0.jsonl", recs)
    spans = intervals(tmp_path, [])
    assert [(s.kind, s.steps) for s in spans] == [("startup", None), ("productive", 10), ("checkpointing", None),
                                                  ("productive", 10), ("other", None), ("productive", 10),
                                                  ("other", None)]
    assert spans[4].seconds == pytest.approx(2.001)
    seconds = compute(tmp_path, []).seconds
    # NOTE: the bookkeeping between steps (28 gaps of 1 ms) and the checks that saved nothing count as productive.
    assert seconds["checkpointing"] == pytest.approx(0.1)
    assert seconds["productive"] == pytest.approx(30 * 0.2 - 0.1 + 28 * 0.001)


def test_time_claimed_twice_goes_to_the_steps_that_ran_in_it(tmp_path: Path) -> None:
    # A straggler detected at 5.5 and notified at 5.6 while the job trained on: steps 0..9 of 1 s from 1 to 11.
    write(tmp_path / "supervisor" / "attempts.jsonl", [{"event": "start", "attempt": 0, "at": 0.0},
                                                       {"event": "end", "attempt": 0, "at": 11.5}])
    write(tmp_path / "ranks" / "0.jsonl", [{"step": s, "time": 2.0 + s, "step_seconds": 1.0} for s in range(10)])
    inc = {"id": 1, "kind": "straggler", "attempt": 0, "detected_at": 5.5, "decided_at": 5.6, "state": "resolved"}
    assert [s.kind for s in intervals(tmp_path, [inc])] == ["startup", "productive", "other"]
    ledger = compute(tmp_path, [inc])
    assert ledger.seconds["productive"] == 10.0 and ledger.seconds["detection"] == ledger.seconds["diagnosis"] == 0
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.wall_s)
    assert ledger.incidents[0]["detected_in_s"] == pytest.approx(0.5)
