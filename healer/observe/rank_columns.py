"""Every rank's latest heartbeat as columns: per job, one numpy array per field the detectors compute over, written
as each batch is stored (healer/observe/heartbeats.py) and copied once per detection cycle.

Why columns beside the table's RankBeat objects: a detection cycle that reads 131,072 rank objects spends most of
a second on that alone (a Python step per rank and field), where the same reads over arrays take milliseconds. So
the numbers each cycle needs (step, step and phase times, loss, pid, pipeline stage, node, a few flags) are
written at ingest (~1 us a rank, most of it reading the entry: one packed record per rank), and the cycle works on
a copy of them as arrays. A relay's batch by column (wire/relay.py) is written with numpy for all its
rows at once (RankColumns.write_rows: ~0.6 us a rank, most of it finding each rank's slot). What only an
incident's evidence needs (mesh, events, the non-finite values' names) stays in the RankBeat, which each job's
columns also hold by slot, so a detector can turn the few ranks it names into objects.

Slots: a job's ranks get a slot each in the order they are first seen (a dict rank -> slot, so a sparse or huge
rank number costs one slot, not an array that long). A slot is never reused while its job's columns live; a rank
the table forgets is only marked absent. A job whose every rank is forgotten loses its columns, and a new set
(with a new `epoch`) starts when it reports again: whoever keeps state by slot starts that job afresh.
"""

from __future__ import annotations

import itertools
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from wire.relay import MISSING
from wire.rerun import EVENT as RERUN_EVENT
from wire.rerun import RerunVerdict
from wire.rerun import parse as parse_verdict

if TYPE_CHECKING:
    from healer.observe.heartbeats import RankBeat
    from wire.relay import Rows
    from wire.telemetry import EventBody

NONFINITE, FINISHING, STOPPED, ALIVE = 1, 2, 4, 8
"""Bits of the `flags` column: the record named non-finite values; the rank said it is finishing after its latest
step (the trainer's `finishing` event); its process is stopped (kernel state T or t); its process exists."""

FLOATS = ("heard_at", "step_time", "step_seconds", "compute_s", "data_wait_s", "dp_reduce_s", "checkpoint_s",
          "loss", "grad_norm", "dp_reduce_lag_s")
"""NaN where the record had no value (compute_s: no phases at all)."""
INTS = ("rank", "step", "pid", "stage", "node", "attempt")
"""step, pid and attempt -1 where the record had none; node: an index into RankColumns.node_names."""
STOPPED_STATES = ("T", "t")
"""The kernel's states of a process that was stopped (by a signal, or by a tracer)."""
# NOTE: not `grad_norm_clip`: the global gradient norm is all-reduced over the data-parallel and pipeline groups,
# so that phase is mostly a wait for the other stages' reduce. Counted as compute, a slow link under one stage made
# every rank of the other stage look slow (0.55 s of 0.6 s on the bed).
COMPUTE_PHASES = ("forward_backward", "optimizer")
"""The phases of a step that are the rank's own work, summed into `compute_s` (healer/detect/phases.py)."""
_FORWARD_BACKWARD, _OPTIMIZER = COMPUTE_PHASES
_NAN = math.nan
_epochs = itertools.count(1)


# NOTE: one packed record per rank, written by one struct.pack_into call and read as numpy fields of a structured
# array over the same bytes: 17 stores through memoryviews cost ~1.5 us a rank (a sixth of ingest at 131,072 ranks
# a second), one pack_into ~0.3 us.
_RECORD = struct.Struct("<" + "d" * len(FLOATS) + "q" * len(INTS) + "BB")
_DTYPE = np.dtype([(name, "<f8") for name in FLOATS] + [(name, "<i8") for name in INTS]
                  + [("flags", "u1"), ("present", "u1")])
assert _DTYPE.itemsize == _RECORD.size
_SIZE = _RECORD.size
_SNAPSHOT_BLOCK = 8192
"""Records copied out to columns at a time (JobColumns.snapshot): ~1 MB of them."""
_pack = _RECORD.pack_into


class JobColumns:
    """One job's columns, as ingest writes them (under the table's lock)."""

    def __init__(self, job: str, capacity: int = 64, saved: set[int] | None = None,
                 verdicts: dict[tuple[int | None, int], RerunVerdict] | None = None) -> None:
        self.job = job
        self.saved = set() if saved is None else saved
        """The steps whose checkpoints its ranks said they saved (RankColumns.saved: kept when the columns go)."""
        self.verdicts = {} if verdicts is None else verdicts
        """Its re-runs' verdicts by (attempt, step) (RankColumns.verdicts: kept when the columns go)."""
        self.epoch = next(_epochs)
        self.n = 0
        self.slot_of: dict[int, int] = {}
        self.beats: list[RankBeat | None] = []
        self._buffer = bytearray()
        self.records = np.zeros(0, dtype=_DTYPE)
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        buffer = bytearray(capacity * _SIZE)
        buffer[: len(self._buffer)] = self._buffer
        self._buffer = buffer
        self.records = np.frombuffer(buffer, dtype=_DTYPE)

    def slot(self, rank: int) -> int:
        slot = self.slot_of.get(rank)
        if slot is None:
            if self.n == len(self.records):
                self._allocate(2 * self.n)
            slot = self.slot_of[rank] = self.n
            self.n += 1
            self.beats.append(None)
        return slot

    def write(self, beat: RankBeat, node_id: int) -> None:
        """Store one rank's heartbeat (this runs for every rank of every batch: 131,072 a second at the largest)."""
        e = beat.entry
        rank = e.rank
        slot = self.slot_of.get(rank)
        if slot is None:
            slot = self.slot(rank)
        self.beats[slot] = beat
        step = e.step
        phases = e.phases
        if phases:
            get = phases.get
            compute = get(_FORWARD_BACKWARD, 0.0) + get(_OPTIMIZER, 0.0)
            data_wait, dp_reduce, save = get("data_wait", 0.0), get("dp_reduce", 0.0) + get("dp_gather", 0.0), \
                get("checkpoint", 0.0)
        else:
            compute, data_wait, dp_reduce, save = _NAN, 0.0, 0.0, 0.0
        flags = ALIVE if e.alive else 0
        if e.nonfinite:
            flags |= NONFINITE
        if e.proc_state in STOPPED_STATES:
            flags |= STOPPED
        if e.last_event is not None:
            if finishing_after(e.last_event, step):
                flags |= FINISHING
            note_saved(self.saved, e.last_event)
            note_verdict(self.verdicts, e.last_event)
        # NOTE: in the order of FLOATS, then INTS, flags, present
        _pack(self._buffer, slot * _SIZE, beat.received_at - e.last_seen_age_s,
              _NAN if e.step_time is None else e.step_time, _NAN if e.step_seconds is None else e.step_seconds,
              compute, data_wait, dp_reduce, save, _NAN if e.loss is None else e.loss,
              _NAN if e.grad_norm is None else e.grad_norm, _NAN if e.dp_reduce_lag_s is None else e.dp_reduce_lag_s,
              rank, -1 if step is None else step, -1 if e.pid is None else e.pid, e.mesh.get("pp", 0), node_id,
              -1 if e.attempt is None else e.attempt, flags, 1)

    def write_rows(self, rank: list[int], rows: np.ndarray, values: dict[str, np.ndarray],
                   row_beats: list[RankBeat | None]) -> None:
        """Store the rows `rows` of a relay batch (their ranks in `rank`, by row): `values` has every field of the
        record as an array by row (RankColumns.write_rows made them)."""
        slot_of, beats = self.slot_of, self.beats
        slots = []
        for i in rows.tolist():
            slot = slot_of.get(rank[i])
            if slot is None:
                slot = self.slot(rank[i])
            beats[slot] = row_beats[i]
            slots.append(slot)
        at = np.array(slots, dtype=np.intp)
        records = self.records  # NOTE: after slot(), which may have grown it
        for name, column in values.items():
            records[name][at] = column[rows]
        records["present"][at] = 1

    def drop(self, rank: int) -> None:
        slot = self.slot_of.get(rank)
        if slot is not None:
            self.records["present"][slot] = 0
            self.beats[slot] = None

    def live(self) -> int:
        return int(self.records["present"][: self.n].sum())

    def snapshot(self, node_names: list[str]) -> JobView:
        records, n = self.records, self.n
        arrays = {name: np.empty(n, dtype=_DTYPE[name]) for name in _DTYPE.names or ()}
        # NOTE: a block of records at a time (~1 MB, held in cache while each field is taken out of it): a whole
        # field at once reads a cache line per rank for each of 17 fields (~13 ms at 131,072 ranks, ~4.5 by block).
        for start in range(0, n, _SNAPSHOT_BLOCK):
            block = records[start: min(n, start + _SNAPSHOT_BLOCK)]
            for name, column in arrays.items():
                column[start: start + len(block)] = block[name]
        return JobView(job=self.job, epoch=self.epoch, n=self.n, arrays=arrays,
                       counts=arrays.pop("present").astype(bool), beats=tuple(self.beats), node_names=node_names,
                       verdicts=tuple(self.verdicts.values()))


class RankColumns:
    """Per job, its JobColumns; node names by index. Not thread-safe: the heartbeat table's lock guards it."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobColumns] = {}
        self.saved: dict[str, set[int]] = {}
        """Per job, the steps of the checkpoints its ranks said they saved (a `checkpoint_saved` event with its
        `step`): a user's program keeps its checkpoints where megaheal cannot list them, and this is what a rollback
        can go back to. Kept across the job's columns coming and going between attempts."""
        self.verdicts: dict[str, dict[tuple[int | None, int], RerunVerdict]] = {}
        """Per job, its re-runs' verdicts (a `rerun` event, wire/rerun.py) by (attempt, step); kept likewise."""
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
            cols = self.jobs[job] = JobColumns(job, saved=self.saved.setdefault(job, set()),
                                               verdicts=self.verdicts.setdefault(job, {}))
        return cols

    def write_rows(self, rows: Rows, received: np.ndarray, node_ids: np.ndarray,
                   row_beats: list[RankBeat | None]) -> None:
        """Store a relay batch's rows (wire/relay.py) at once: each field converted to an array over all
        rows with numpy, then scattered into each job's records. Rows whose `received` is NaN are not stored (their
        node's newer batch is already here)."""
        n = len(rows)
        if n == 0:
            return
        values = _row_values(rows, received, node_ids)
        stored = ~np.isnan(received)
        rank = rows.columns["rank"].tolist()
        job_of = rows.columns["job"]
        for row, extra in rows.extras.items():
            if extra.last_event is not None and stored[row]:
                cols = self.job(rows.jobs[int(job_of[row])])
                note_saved(cols.saved, extra.last_event)
                note_verdict(cols.verdicts, extra.last_event)
        if len(rows.jobs) == 1:
            self.job(rows.jobs[0]).write_rows(rank, np.flatnonzero(stored), values, row_beats)
            return
        for j, name in enumerate(rows.jobs):
            mine = np.flatnonzero(stored & (job_of == j))
            if len(mine):
                self.job(name).write_rows(rank, mine, values, row_beats)

    def drop(self, keys: list[tuple[str, int]]) -> None:
        """Mark the ranks `keys` (job, rank) absent; a job with no rank left loses its columns."""
        for job, rank in keys:
            cols = self.jobs.get(job)
            if cols is not None:
                cols.drop(rank)
        for job in {job for job, _ in keys}:
            cols = self.jobs.get(job)
            if cols is not None and cols.live() == 0:  # NOTE: once per job, not per rank (a sum over its slots)
                del self.jobs[job]

    def snapshot(self) -> dict[str, JobView]:
        return {job: cols.snapshot(self.node_names) for job, cols in self.jobs.items()}


def note_saved(saved: set[int], event: EventBody) -> None:
    """Add the step of a `checkpoint_saved` event (megaheal.rank.event("checkpoint_saved", step=N)) to `saved`."""
    # NOTE: fields are free-form: only a whole step >= 0 counts.
    step = event.fields.get("step") if event.name == "checkpoint_saved" else None
    if type(step) is int and step >= 0:
        saved.add(step)


MAX_VERDICTS = 256
"""Verdicts kept per job (the oldest go first): a host that keeps failing its re-runs is convicted long before."""


def note_verdict(verdicts: dict[tuple[int | None, int], RerunVerdict], event: EventBody) -> None:
    """Keep the verdict of a `rerun` event (its fields are a rank's: checked, a bad one logged and dropped)."""
    if event.name != RERUN_EVENT:
        return
    verdict = parse_verdict(event.fields)
    if verdict is None:
        return
    verdicts[(verdict.attempt, verdict.step)] = verdict
    while len(verdicts) > MAX_VERDICTS:
        del verdicts[next(iter(verdicts))]


def finishing_after(event: EventBody | None, step: int | None) -> bool:
    """Whether `event` is the trainer's `finishing`, sent after the step `step` (the rank ends cleanly next)."""
    # NOTE: an event's fields are free-form (whatever the trainer passed); `step` is the one finishing sets.
    return event is not None and event.name == "finishing" and event.fields.get("step") == (step or 0) + 1


def _row_values(rows: Rows, received: np.ndarray, node_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Every field of the packed record (but `present`), as an array over the rows of a relay batch: what
    JobColumns.write computes for one entry, for all of them at once."""
    n, col = len(rows), rows.columns
    phases = rows.groups["phases"]
    missing = np.full(n, np.nan)
    some_phase = np.zeros(n, dtype=bool)
    for column in phases.values():
        some_phase |= ~np.isnan(column)

    def phase(*names: str) -> np.ndarray:
        return sum((np.nan_to_num(phases.get(name, missing)) for name in names), np.zeros(n))

    def ints(column: np.ndarray | None, default: int) -> np.ndarray:
        return np.full(n, default, dtype=np.int64) if column is None else np.where(column == MISSING, default, column)

    compute = phase(*COMPUTE_PHASES)
    compute[~some_phase] = np.nan
    flags = np.where(col["alive"] != 0, ALIVE, 0).astype(np.uint8)
    states = np.frombuffer(rows.proc_state.encode("utf-32-le"), dtype=np.uint32)
    flags[np.isin(states, [ord(s) for s in STOPPED_STATES])] |= STOPPED
    step = ints(col["step"], -1)
    for row, extra in rows.extras.items():
        if extra.nonfinite:
            flags[row] |= NONFINITE
        if finishing_after(extra.last_event, rows.value("step", row)):
            flags[row] |= FINISHING
    return {"heard_at": received - col["last_seen_age_s"], "step_time": col["step_time"],
            "step_seconds": col["step_seconds"], "compute_s": compute, "data_wait_s": phase("data_wait"),
            "dp_reduce_s": phase("dp_reduce", "dp_gather"), "checkpoint_s": phase("checkpoint"), "loss": col["loss"],
            "grad_norm": col["grad_norm"], "dp_reduce_lag_s": col["dp_reduce_lag_s"], "rank": col["rank"],
            "step": step, "pid": ints(col["pid"], -1), "stage": ints(rows.groups["mesh"].get("pp"), 0),
            "node": node_ids, "attempt": ints(col["attempt"], -1), "flags": flags}


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
    verdicts: tuple[RerunVerdict, ...] = ()
    """The job's re-run verdicts so far (the trainer's `rerun` events), oldest first."""

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.arrays[name]
        except KeyError:
            raise AttributeError(name) from None

    def only(self, keep: np.ndarray) -> JobView:
        """The same columns with only the slots in `keep` (a boolean array) counted."""
        return JobView(self.job, self.epoch, self.n, self.arrays, self.counts & keep, self.beats, self.node_names,
                       self.verdicts)

    def counted_beats(self) -> list[RankBeat]:
        """The RankBeats of the slots that count (a pass in Python: for a finding's evidence, not for every cycle)."""
        beats = self.beats
        return [b for i in np.flatnonzero(self.counts) if (b := beats[i]) is not None]
