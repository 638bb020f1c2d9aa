"""The healer's side of the self-tuning intervals (healer/launchers/save_tuning.py): the stalls measured from rank 0's
step records, the moves made at a restart and their `--set` items, and their way into a warm generation's plan
(wire/warm_plan.py, healer/launchers/warm_control.py) and the warm worker's config (train/warm/worker.py)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest

from healer.decide.save_interval import IntervalBounds, optimum
from healer.launchers.save_tuning import Intervals, SaveTuning, measure
from healer.launchers.warm_control import _split
from wire.journal import Retuned
from wire.run_paths import RunPaths
from wire.step_record import StepRecord
from wire.warm_plan import Plan

pytestmark = pytest.mark.unit


def records(n: int, intervals: Intervals, *, step_s: float = 1.0, save_s: float = 0.5, snap_s: float = 0.1
            ) -> list[StepRecord]:
    """`n` steps of `step_s`, each save (after step s, (s + 1) % every == 0) and snapshot stalling its step."""
    out = []
    for s in range(n):
        done = s + 1
        stall = (save_s if done % intervals.every_steps == 0 else
                 snap_s if intervals.snapshot_every_steps and done % intervals.snapshot_every_steps == 0 else 0.0)
        out.append(StepRecord(step=s, time=1000.0 + s, loss=1.0, step_seconds=step_s + stall,
                              phases={"forward_backward": step_s, "checkpoint": stall}))
    return out


def test_the_stalls_are_read_from_the_steps_that_saved_and_those_that_only_took_a_snapshot() -> None:
    every = Intervals(every_steps=10, snapshot_every_steps=2)
    assert measure(records(40, every), every) == pytest.approx((1.0, 0.5, 0.1))
    # Too few of a kind to trust: not measured.
    assert measure(records(12, every), every) == pytest.approx((1.0, None, 0.1))
    assert measure([], every) == (None, None, None)


def test_a_restart_moves_the_intervals_for_the_failures_seen_and_says_so_in_the_next_attempts_items() -> None:
    configured = Intervals(every_steps=10, snapshot_every_steps=2)
    tuning = SaveTuning(configured, IntervalBounds(least=timedelta(seconds=1)), started_at=0.0)
    assert tuning.overrides() == ()
    # A job of 1 s steps, a 0.1 s snapshot every 2 steps and a 0.5 s save every 10: the configured intervals are
    # Young's optimum for failures every 2^2 / 0.2 = 20 s (snapshots) and 10^2 / 1 = 100 s (saves). 8 warm restarts
    # in its first 80 s and none from the disk: the snapshots' estimate is (80 + 20) / 9 = 11.1 s, the saves'
    # (80 + 100) / 1 = 180 s.
    for at in range(10, 90, 10):
        tuning.failed(float(at), from_disk=False)
    moves = {m.what: m for m in tuning.retune(records(60, configured), at=80.0)}
    assert moves["snapshot"].change.mtbf_s == pytest.approx(100 / 9)
    assert moves["snapshot"].steps == round(optimum(0.1, 100 / 9)) == 1 and moves["snapshot"].previous_steps == 2
    assert moves["save"].change.mtbf_s == pytest.approx(180.0)
    assert moves["save"].steps == round(optimum(0.5, 180.0)) == 13
    assert tuning.current == Intervals(every_steps=13, snapshot_every_steps=1)
    assert tuning.overrides() == ("checkpoint.every_steps=13", "snapshot_every_steps=1")
    assert "8 failure(s) in the window" in moves["snapshot"].change.reason
    # The bounds win over the optimum: at the default 30 s at least, both intervals only grow (at most twice).
    bounded = SaveTuning(configured, started_at=0.0)
    for at in range(10, 90, 10):
        bounded.failed(float(at), from_disk=False)
    bounded.retune(records(60, configured), at=80.0)
    assert bounded.current == Intervals(every_steps=20, snapshot_every_steps=4)


def test_without_a_warm_pool_only_the_saves_are_tuned_by_every_restart() -> None:
    tuning = SaveTuning(Intervals(every_steps=4, snapshot_every_steps=None), started_at=0.0)
    for at in range(10, 200, 10):
        tuning.failed(float(at), from_disk=False)
    (move,) = tuning.retune(records(40, tuning.current, save_s=2.0), at=200.0)
    assert move.what == "save" and move.steps > 4
    assert tuning.overrides() == (f"checkpoint.every_steps={move.steps}",)


def test_the_tuned_items_ride_in_a_warm_plan_and_not_in_the_pinned_settings() -> None:
    pinned, skip, tuned = _split(("job=j", "steps=100", "skip_steps=[3,4]", "checkpoint.every_steps=8",
                                  "snapshot_every_steps=2", "checkpoint.every_steps=16"))
    assert pinned == ("job=j", "steps=100") and skip == [3, 4]
    assert tuned == {"every_steps": 16, "snapshot_every_steps": 2}, "the last of each wins, as in --set"
    plan = Plan(generation=1, world=2, assign={"a": 0, "b": 1}, local_rank={"a": 0, "b": 1}, **tuned)
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="an interval is an integer >= 1"):
        Plan(generation=1, world=1, assign={"a": 0}, local_rank={"a": 0}, every_steps=0)


def test_at_a_restart_the_failed_attempts_records_are_read_and_each_move_journalled(tmp_path: Path) -> None:
    configured = Intervals(every_steps=10, snapshot_every_steps=None)
    path = RunPaths(tmp_path).rank_records(0)
    path.parent.mkdir(parents=True)
    began = time.time() - 60  # the attempt's start: its 30 steps ended in the minute before the restart
    recs = [msgspec.structs.replace(r, time=began + 1 + r.step) for r in records(30, configured)]
    path.write_text("".join(msgspec.json.encode(r).decode() + "\n" for r in recs))
    tuning = SaveTuning(configured, started_at=began - 10)
    journal: list[Retuned] = []
    tuning.at_restart(tmp_path, (3, began), warm=False, journal=journal.append)
    # One failure, from the disk; saves of 0.5 s every 10 s at 1 s a step: held at the 30 s least, doubled.
    (event,) = journal
    assert (event.what, event.steps, event.previous_steps, event.attempt) == ("save", 20, 10, 4)
    assert tuning.disk_failures and tuning.overrides() == ("checkpoint.every_steps=20",)
    # An attempt with no records of its own moves nothing (its stalls are not measured), and says nothing.
    again: list[Retuned] = []
    tuning.at_restart(tmp_path / "elsewhere", (4, time.time()), warm=True, journal=again.append)
    assert not again and len(tuning.failures) == 2
