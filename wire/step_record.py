"""The trainer's record of one step, one JSON object per line in `<run_dir>/ranks/<rank>.jsonl` (wire/run_paths.py):
built as this struct by the trainer (train/trainer.py), read back through `read` by the healer (a rollback's first bad
step, an attempt's first and highest step).

The lines are written by Python's json: a NaN or infinite loss is written as NaN or Infinity (what the nonfinite
detector and a rollback look for), which strict JSON decoders refuse, so a line is parsed by `json` and then
converted. A torn line (a rank killed mid-write) is skipped, as in every journal of a run; so is a record that does
not fit (an older trainer's), with a warning naming file and line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct

log = logging.getLogger(__name__)


class StepRecord(Struct, kw_only=True):
    step: int
    """The step's index (0-based): the record of the job's `step`-th step."""
    time: float
    """Unix time at which the step ended."""
    loss: float
    """May be NaN or infinite."""
    step_seconds: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    tokens: int = 0
    tokens_per_second: float = 0.0
    mfu: float = 0.0
    peak_flops: float = 0.0
    peak_source: str = ""
    """Where the peak of MFU's denominator came from (a table of GPUs by name, or a probe)."""
    phases: dict[str, float] = {}
    """Seconds per phase of the step (forward_backward, dp_reduce, pp_wait, optimizer, checkpoint, ...)."""
    dp_reduce_enter_ns: int | None = None
    """CLOCK_MONOTONIC at which the rank entered the step's dp reduce (comparable within a node)."""
    sample_index: int = 0
    """The data position after the step (the global sample index)."""
    checkpoint_events: list[dict[str, Any]] = []
    max_rss_mib: float = 0.0
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    mesh: dict[str, int] = {}
    """The rank's coordinates: pp, dp, tp."""
    node: str | None = None
    pid: int = 0
    attempt: int | None = None
    """The job's attempt the step is of (MEGAHEAL_ATTEMPT; None outside a launcher): a warm worker's process trains
    in one attempt after another, and a step of the attempt it is leaving may end after the next one began."""
    replica_group: int | None = None
    """Under fault tolerance per replica group (train/ft/): the rank's group. `rank` is then numbered over the whole
    job (group x the group's world size + the rank in its group), and `world_size` is the group's."""
    replicas: int | None = None
    """Under fault tolerance per replica group: the groups that took part in the step (its quorum)."""
    rerun: str | None = None
    """The verdict of the step's re-runs, when it was suspect (wire/rerun.py): transient, persistent, data, state or
    inconclusive; every verdict but transient skipped the step's update."""


def to_line(record: StepRecord) -> dict[str, Any]:
    """The record as the JSON object its line holds (NaN stays a float: json writes it as NaN)."""
    return msgspec.to_builtins(record)  # type: ignore[no-any-return]


def read(path: Path) -> list[StepRecord]:
    """Every record of one rank's file in order that fits; [] when there is none yet."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        try:
            raw = json.loads(line)
        except ValueError:
            continue  # torn
        try:
            records.append(msgspec.convert(raw, StepRecord))
        except msgspec.ValidationError as exc:
            log.warning("%s:%d: a step record that does not fit, skipped: %s", path, lineno, exc)
    return records
