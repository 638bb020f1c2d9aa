"""Every rank's latest heartbeat as columns: per job, one numpy array per field the detectors compute over, written
as each batch is stored (healer/core/heartbeats.py) and copied once per detection cycle.

Why columns beside the table's RankBeat objects: a detection cycle that reads 131,072 rank objects spends most of
a second on that alone (a Python step per rank and field), where the same reads over arrays take milliseconds. So
the numbers each cycle needs (step, step and phase times, loss, pid, pipeline stage, node, a few flags) are
written into arrays at ingest (~1 us a rank: a store per field through a memoryview), and the cycle works on a
copy of them. What only an incident's evidence needs (mesh, events, the non-finite values' names) stays in the
RankBeat, which each job's columns also hold by slot, so a detector can turn the few ranks it names into objects.

Slots: a job's ranks get a slot each in the order they are first seen (a dict rank -> slot, so a sparse or huge
rank number costs one slot, not an array that long). A slot is never reused while its job's columns live; a rank
the table forgets is only marked absent. A job whose every rank is forgotten loses its columns, and a new set
(with a new `epoch`) starts when it reports again: whoever keeps state by slot starts that job afresh.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from healer.core.heartbeats import RankBeat

NONFINITE, FINISHING, STOPPED, ALIVE = 1, 2, 4, 8
"""Bits of the `flags` column: the record named non-finite values; the rank said it is finishing after its latest
step (the trainer's `finishing` event); its process is stopped (kernel state T or t); its process exists."""

FLOATS = ("heard_at", "step_time", "step_seconds", "compute_s", "data_wait_s", "dp_reduce_s", "checkpoint_s",
          "loss", "grad_norm", "dp_reduce_lag_s")
"""NaN where the record had no value (compute_s: no phases at all)."""
INTS = ("rank", "step", "pid", "stage", "node")
"""step and pid -1 where the record had none; node: an index into RankColumns.node_names."""
_STOPPED_STATES = ("T", "t")
_FORWARD_BACKWARD, _OPTIMIZER = "forward_backward", "optimizer"  # healer/core/detectors/history.py's COMPUTE_PHASES
_NAN = math.nan
_epochs = itertools.count(1)


class JobColumns:
    """One job's columns, as ingest writes them (under the table's lock)."""

    def __init__(self, job: str, capacity: int = 64) -> None:
        self.job = job
        self.epoch = next(_epochs)
        self.n = 0
        self.slot_of: dict[int, int] = {}
        self.beats: list[RankBeat | None] = []
        self.arrays: dict[str, np.ndarray] = {}
        self._views: tuple[memoryview, ...] = ()
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        old = self.arrays
        arrays = {name: np.full(capacity, _NAN) for name in FLOATS}
        arrays |= {name: np.full(capacity, -1, dtype=np.int64) for name in INTS}
        arrays["flags"] = np.zeros(capacity, dtype=np.uint8)
        arrays["present"] = np.zeros(capacity, dtype=np.uint8)
        for name, values in old.items():
            arrays[name][: self.n] = values[: self.n]
        self.arrays = arrays
        # NOTE: in the order write() unpacks them: FLOATS, INTS, flags, present
        self._views = tuple(memoryview(values) for values in arrays.values())  # type: ignore[arg-type]

    def slot(self, rank: int) -> int:
        slot = self.slot_of.get(rank)
        if slot is None:
            if self.n == len(self.arrays["rank"]):
                self._allocate(2 * self.n)
            slot = self.slot_of[rank] = self.n
            self.n += 1
            self.beats.append(None)
            self.arrays["rank"][slot] = rank
        return slot

    def write(self, beat: RankBeat, node_id: int) -> None:
        """Store one rank's heartbeat. NOTE: positional stores through memoryviews, field by field: this runs for
        every rank of every batch (131,072 a second at the largest), and a numpy item store costs twice as much."""
        e = beat.entry
        slot = self.slot(e.rank)
        (heard_at, step_time, step_seconds, compute, data_wait, dp_reduce, save, loss, grad_norm, lag,
         _, step_v, pid, stage, node, flags_v, present) = self._views
        self.beats[slot] = beat
        present[slot] = 1
        step = e.step
        step_v[slot] = -1 if step is None else step
        pid[slot] = -1 if e.pid is None else e.pid
        node[slot] = node_id
        stage[slot] = e.mesh.get("pp", 0)
        heard_at[slot] = beat.received_at - e.last_seen_age_s
        step_time[slot] = _NAN if e.step_time is None else e.step_time
        step_seconds[slot] = _NAN if e.step_seconds is None else e.step_seconds
        phases = e.phases
        if phases:
            get = phases.get
            compute[slot] = get(_FORWARD_BACKWARD, 0.0) + get(_OPTIMIZER, 0.0)
            data_wait[slot] = get("data_wait", 0.0)
            dp_reduce[slot] = get("dp_reduce", 0.0) + get("dp_gather", 0.0)
            save[slot] = get("checkpoint", 0.0)
        else:
            compute[slot] = _NAN
            data_wait[slot] = dp_reduce[slot] = save[slot] = 0.0
        loss[slot] = _NAN if e.loss is None else e.loss
        grad_norm[slot] = _NAN if e.grad_norm is None else e.grad_norm
        lag[slot] = _NAN if e.dp_reduce_lag_s is None else e.dp_reduce_lag_s
        flags = ALIVE if e.alive else 0
        if e.nonfinite:
            flags |= NONFINITE
        if e.proc_state in _STOPPED_STATES:
            flags |= STOPPED
        event = e.last_event
        # NOTE: an event's fields are free-form (whatever the trainer passed); `step` is the one finishing sets.
        if event is not None and event.name == "finishing" and event.fields.get("step") == (step or 0) + 1:
            flags |= FINISHING
        flags_v[slot] = flags

    def drop(self, rank: int) -> None:
        slot = self.slot_of.get(rank)
        if slot is not None:
            self.arrays["present"][slot] = 0
            self.beats[slot] = None

    def live(self) -> int:
        return int(self.arrays["present"][: self.n].sum())

    def snapshot(self, node_names: list[str]) -> JobView:
        arrays = {name: values[: self.n].copy() for name, values in self.arrays.items()}
        return JobView(job=self.job, epoch=self.epoch, n=self.n, arrays=arrays,
                       counts=arrays.pop("present").astype(bool), beats=tuple(self.beats), node_names=node_names)


class RankColumns:
    """Per job, its JobColumns; node names by index. Not thread-safe: the heartbeat table's lock guards it."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobColumns] = {}
        self.node_names: list[str] = []
        self._node_ids: dict[str, int] = {}

    def node_id(self, node: str) -> int:
        nid = self._node_ids.get(node)
        if nid is None:
            nid = self._node_ids[node] = len(self.node_names)
            self.node_names.append(node)  # NOTE: only appended to: a snapshot may share the list
        return nid

    def job(self, job: str) -> JobColumns:
        cols = self.jobs.get(job)
        if cols is None:
            cols = self.jobs[job] = JobColumns(job)
        return cols

    def drop(self, job: str, rank: int) -> None:
        cols = self.jobs.get(job)
        if cols is not None:
            cols.drop(rank)
            if cols.live() == 0:
                del self.jobs[job]

    def snapshot(self) -> dict[str, JobView]:
        return {job: cols.snapshot(self.node_names) for job, cols in self.jobs.items()}


@dataclass(frozen=True, slots=True)
class JobView:
    """One job's columns as one detection cycle sees them (a copy: ingest goes on meanwhile). `counts` marks the
    slots that count in this cycle: the ranks present and, under a launcher, those of the current attempt."""

    job: str
    epoch: int
    n: int
    arrays: dict[str, np.ndarray]
    counts: np.ndarray
    beats: tuple[RankBeat | None, ...]
    """By slot: the RankBeat each slot's numbers came from (None: absent)."""
    node_names: list[str]

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.arrays[name]
        except KeyError:
            raise AttributeError(name) from None

    def only(self, keep: np.ndarray) -> JobView:
        """The same columns with only the slots in `keep` (a boolean array) counted."""
        return JobView(self.job, self.epoch, self.n, self.arrays, self.counts & keep, self.beats, self.node_names)

    def counted_beats(self) -> list[RankBeat]:
        """The RankBeats of the slots that count (a pass in Python: for a finding's evidence, not for every cycle)."""
        beats = self.beats
        return [b for i in np.flatnonzero(self.counts) if (b := beats[i]) is not None]
