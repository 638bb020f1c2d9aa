"""The goodput ledger over a run directory written the way the supervisor, the loop and the trainer write it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from healer.goodput import compute
from healer.goodput_report import report


def write(path: Path, entries: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))


def test_it_splits_wall_time_into_productive_checkpoint_lost_detection_restart_and_startup(tmp_path: Path) -> None:
    # Attempt 0 starts at 0, first step begins at 10, steps 0..5 take 1 s each (step 3 saves: 0.5 s stall);
    # it dies during step 6; detected at 19, decided at 19.5, attempt 1 starts at 21, resumes from the checkpoint
    # of step 4 (steps 4, 5 redone), first step begins at 26, steps 4..9 take 1 s each; ends at 33.
    write(tmp_path / "supervisor" / "attempts.jsonl", [
        {"event": "start", "attempt": 0, "at": 0.0}, {"event": "end", "attempt": 0, "at": 20.5},
        {"event": "start", "attempt": 1, "at": 21.0}, {"event": "end", "attempt": 1, "at": 33.0}])
    recs = [{"step": s, "time": 11.0 + s, "step_seconds": 1.0, "phases": {"checkpoint": 0.5 if s == 3 else 0.0}}
            for s in range(6)]
    recs += [{"step": s, "time": 27.0 + (s - 4), "step_seconds": 1.0, "phases": {}} for s in range(4, 10)]
    write(tmp_path / "ranks" / "0.jsonl", recs)
    inc = {"id": 1, "kind": "crash", "attempt": 0, "detected_at": 19.0, "remediated_at": 21.0, "recovered_at": 27.0,
           "suspect_ranks": [3], "suspect_nodes": ["n2"], "lost_steps": 2, "state": "resolved", "action": "restart-in-place",
           "plan": {"decision_basis": {"verdict": None}}}
    write(tmp_path / "incidents.jsonl", [{"event": "detected", "at": 19.0, "incident": inc},
                                         {"event": "decided", "at": 19.5, "incident": inc},
                                         {"event": "recovered", "at": 27.0, "incident": inc}])
    ledger = compute(tmp_path)
    assert ledger.wall_s == 33.0 and ledger.attempts == 2 and ledger.steps_done == 10 and ledger.lost_steps == 2
    s = ledger.seconds
    assert s["productive"] == pytest.approx(10 - 0.5) and s["checkpointing"] == pytest.approx(0.5)
    assert s["lost_work"] == pytest.approx(2.0) and s["detection"] == pytest.approx(19.0 - 16.0)
    assert s["diagnosis"] == pytest.approx(0.5) and s["restart"] == pytest.approx(1.5)
    assert s["startup"] == pytest.approx(10.0 + 5.0)
    assert sum(s.values()) == pytest.approx(33.0) and ledger.ettr == pytest.approx(9.5 / 33, abs=1e-4)
    (row,) = ledger.incidents
    assert row["detected_in_s"] == pytest.approx(3.0) and row["recovered_in_s"] == pytest.approx(11.0)
    report(tmp_path, quiet=True)
    assert json.loads((tmp_path / "report.json").read_text())["ettr"] == ledger.ettr


def test_an_unsupervised_run_has_no_ledger(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a supervised run"):
        compute(tmp_path)
