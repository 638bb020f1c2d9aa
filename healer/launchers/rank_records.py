"""Reading the ranks' own record of every step (`<run_dir>/ranks/0.jsonl`, line-buffered by the trainer before it
sends the heartbeat record) and the attempts' journal (wire/journal.py).

Heartbeats sample steps: a fast job may do two steps between two batches. Where one step matters (the step an
attempt resumed at, the first step of a NaN or a loss spike), it is read here, from every step rank 0 recorded.
Every rank logs the same all-reduced loss, and rank 0 exists at every data-parallel degree.
"""

from __future__ import annotations

import math
from pathlib import Path

from healer.detect.loss_spike import LossSpike, robust_z
from wire import step_record
from wire.journal import Journal
from wire.run_paths import RunPaths
from wire.step_record import StepRecord


def attempt_window(run_dir: Path, attempt: int) -> tuple[float, float | None] | None:
    """(start, start of the next attempt or None) of `attempt`, from the journal; None when it never started."""
    return Journal.of(RunPaths(run_dir).journal).window(attempt)


def rank0_steps(run_dir: Path, since: float, until: float | None = None,
                attempt: int | None = None) -> list[StepRecord]:
    """Rank 0's step records that ended within [since, until) (wire/step_record.py); with `attempt`, not those that
    say they are of another one (a warm worker's aborted attempt can end a step after the next attempt began)."""
    return [r for r in step_record.read(RunPaths(run_dir).rank_records(0))
            if r.time >= since and (until is None or r.time < until)
            and (attempt is None or r.attempt is None or r.attempt == attempt)]


def first_step(run_dir: Path, attempt: int) -> int | None:
    window = attempt_window(run_dir, attempt)
    records = rank0_steps(run_dir, *window, attempt=attempt) if window else []
    return records[0].step if records else None


def highest_step(run_dir: Path, attempt: int) -> int | None:
    window = attempt_window(run_dir, attempt)
    records = rank0_steps(run_dir, *window, attempt=attempt) if window else []
    return max(r.step for r in records) if records else None


def first_nonfinite_step(run_dir: Path, since: float, attempt: int | None = None) -> int | None:
    """The first step after `since` (of `attempt`) whose loss or grad norm rank 0 recorded as NaN or infinite."""
    for rec in rank0_steps(run_dir, since, attempt=attempt):
        if not (math.isfinite(rec.loss) and math.isfinite(rec.grad_norm)):
            return rec.step
    return None


def first_spike_step(run_dir: Path, since: float, config: LossSpike.Config, seen: int | None = None,
                     attempt: int | None = None) -> int | None:
    """The first step after `since` whose loss is a spike by the loss_spike detector's own test, over every
    step rank 0 recorded (the detector itself sees only the steps the heartbeats sampled).

    With `seen`, the step the detector saw spike: only a spiking step of the `config.window` steps up to it (the
    heartbeats skip a few steps at most). NOTE: an earlier blip that calmed down again is no part of this spike: a
    long run has them (the demo's loss blipped 138 steps before one), and a rollback past it found no checkpoint
    old enough and escalated."""
    lowest = None if seen is None else seen - config.window
    window: list[float] = []
    for rec in rank0_steps(run_dir, since, attempt=attempt):
        loss = rec.loss
        if len(window) >= config.min_samples and robust_z(loss, window, config.min_mad)[0] > config.threshold \
                and (lowest is None or rec.step >= lowest):
            return rec.step
        window = (window + [loss])[-config.window:]
    return None



def first_step_since(run_dir: Path, ranks: list[int], since: float) -> int | None:
    """The first step any of `ranks` recorded at or after `since` (each rank's own file), or None."""
    steps = [r.step for rank in ranks for r in step_record.read(RunPaths(run_dir).rank_records(rank)) if r.time >= since]
    return min(steps) if steps else None
