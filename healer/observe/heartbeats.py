"""Heartbeat batches from the node sidecars (wire/telemetry.py's HeartbeatBatch, schema 1): decoding, and the
in-memory table of every rank's latest heartbeat that the detectors read.

The stream is kept in memory only: at 12,288 ranks and one batch per node per second, writing each
heartbeat to the database would cost more than the whole healer. What must survive a restart
(incidents, nodes) is written by the engine, not here. A batch is decoded into the same typed structs
the sidecar built, validated as it is decoded; fields a newer sidecar adds are ignored, so it is still
accepted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from msgspec import Struct

from healer.errors import BadRequest, WrongSender
from healer.observe.nodes import NodeTable
from healer.observe.processes import ProcessView
from healer.observe.rank_columns import JobView, RankColumns
from wire.relay import Relayed, Rows, decode_relay_batch
from wire.telemetry import GpuEntry, HeartbeatBatch, RankEntry, SchemaError, convert_batch, decode_batch


# NOTE: msgspec Structs with gc=False, not dataclasses: the table holds one RankBeat per rank and replaces all of
# them every second. As objects the garbage collector tracks, 131,072 of them made it run a full collection (~90 ms)
# about three times a second, ~40% of the healer's time (bench/healer_ingest.py). They hold no reference cycles
# (strings, numbers and the sidecar's own gc=False structs), so the collector need not look at them.
def _read(name: str) -> property:
    """A RankBeat's field `name`, read from its entry, or from the relay batch's column at its row."""

    def get(beat: RankBeat) -> Any:
        source, row = beat.source, beat.row
        return getattr(source, name) if row < 0 else source.value(name, row)  # type: ignore[union-attr]

    return property(get, doc=f"The rank's {name}, as RankEntry.{name}.")


class RankBeat(Struct, frozen=True, gc=False):
    """The latest heartbeat of one rank, as the healer keeps it: the rank's entry and where and when it arrived.

    NOTE: a rank that came by column (a relay's batch, wire/relay.py) keeps only a reference to the batch's
    rows and its row, not an entry of its own: `entry` builds that when asked (~3 us; for evidence), while the few
    fields every cycle may read (job, rank, pid, step, ...) are read from the columns directly."""

    node: str
    received_at: float
    """Healer clock (unix seconds) when the batch carrying it arrived."""
    source: RankEntry | Rows
    """The rank's entry as its node's batch carried it, or the rows of the relay batch that hold it (at `row`)."""
    row: int = -1

    @property
    def entry(self) -> RankEntry:
        """The rank's entry as the sidecar sent it (step, phases, loss, pid, last event, ...)."""
        source = self.source
        return source if self.row < 0 else source.entry(self.row)  # type: ignore[union-attr,return-value]

    rank = _read("rank")
    alive = _read("alive")
    pid = _read("pid")
    step = _read("step")
    attempt = _read("attempt")
    """The attempt its step belongs to, when the rank said (RankEntry.attempt)."""
    last_seen_age_s = _read("last_seen_age_s")
    """How old the rank's newest record was when the sidecar sent the batch."""
    proc_state = _read("proc_state")

    @property
    def job(self) -> str:
        source, row = self.source, self.row
        return source.job if row < 0 else source.job(row)  # type: ignore[union-attr,operator,return-value]

    def staleness(self, now: float) -> float:
        """Seconds since this rank last reported a record, as far as the healer can tell."""
        return max(0.0, now - self.received_at) + self.last_seen_age_s


class NodeBeat(Struct, frozen=True, kw_only=True, gc=False):
    """A node's latest batch: its ranks, and the age of its oldest rank record, so that a detection cycle can
    clear a healthy node with one comparison instead of looking at each of its ranks."""

    node: str
    received_at: float
    seq: int
    ranks: tuple[RankBeat, ...]
    max_age_s: float
    jobs: tuple[str, ...]
    gpus: tuple[GpuEntry, ...] = ()
    """The node's GPU health entries as the sidecar sent them (the gpu_fault detector reads them)."""
    gpus_flagged: bool = False
    """Whether any of `gpus` has a fault field set (gpu_flagged): the gpu_fault detector looks no further at a node
    without one (nearly every node, every cycle)."""
    agent_url: str | None = None
    """Where the host's node agent takes orders (None: a bare sidecar sent the batch)."""
    relay: str | None = None
    """The relay that passed the batch on (exporters/relay.py); None: the node posted it to the healer itself."""


def gpu_flagged(gpu: GpuEntry) -> bool:
    """Whether the entry has any field set that may make the GPU faulty (what exactly is, the gpu_fault detector's
    config says)."""
    return bool(gpu.xid_counts or gpu.ecc_dbe_volatile or gpu.row_remap_failure or gpu.row_remap_pending
                or gpu.recovery_action)


def parse_batch(body: bytes | HeartbeatBatch | Any) -> HeartbeatBatch:
    """The batch in `body`: a request's raw JSON (decoded and validated in one step), a batch built in this
    process (an in-process sidecar's, taken as it is), or an already decoded JSON object (validated).
    BadRequest names the offending field ("body" for the whole of it)."""
    if isinstance(body, HeartbeatBatch):
        return body
    try:
        return decode_batch(body) if isinstance(body, bytes) else convert_batch(body)
    except SchemaError as exc:
        raise BadRequest(exc.field or "body", exc.reason) from exc


class HeartbeatTable:
    """The latest heartbeat of every rank and node. Written by the API, read by the detectors (thread-safe).

    One store, each fact kept once: a rank's heartbeat is its slot in its job's columns (healer/observe/
    rank_columns.py: the numbers a cycle computes over, and the RankBeat they came from), a node's latest batch its
    entry in the node table (healer/observe/nodes.py: the NodeBeat and its times as arrays). Every read below is made
    from those two; only `_store` and `_store_rows` write them, under the one lock."""

    histories = None
    """Read alone (a detector's tests), the table shares no samples between detectors (healer/observe/jobview.py)."""

    def __init__(self, clock: Callable[[], float] = time.time, forget_after_s: float = 3600.0) -> None:
        if forget_after_s <= 0:
            raise ValueError(f"forget_after_s must be > 0, got {forget_after_s}")
        self._clock = clock
        self._forget_after_s = forget_after_s
        self._nodes = NodeTable()
        self._columns = RankColumns()
        """Per job, its ranks' numbers as arrays and their RankBeats by slot (healer/observe/rank_columns.py)."""
        self._lock = threading.Lock()
        self.batches = 0
        self.records = 0
        # NOTE: the launcher's view (exits, process states) sits beside the heartbeats so that a detector still
        # sees one input; it is empty when no launcher runs in this healer.
        self.processes = ProcessView()

    def ingest(self, body: bytes | HeartbeatBatch | Any, sender: str | None = None) -> int:
        """Decode (see parse_batch) and store one batch; returns the number of rank entries taken. Raises BadRequest.
        `sender`: the host whose certificate the batch came with (ground/tls.py): a batch naming another node is
        refused whole (WrongSender), so one host cannot speak for another's GPUs or ranks."""
        batch = parse_batch(body)
        if sender is not None and batch.node != sender:
            raise WrongSender(f"a batch for node {batch.node!r} came with the certificate of host {sender!r}")
        now = self._clock()
        with self._lock:
            taken = self._store(batch, now, None)
        if batch.attempt is not None:
            self.processes.report(batch.node, batch.attempt, now)
        return taken

    def ingest_relayed(self, body: bytes) -> tuple[int, int]:
        """Decode and store a relay's batch (wire/relay.py, by column or, from an older relay, each node's
        batch whole): each node's part as if it had come `age_s` before now. Returns (nodes, rank entries) taken.
        Raises BadRequest naming the field, and then stores none of it (a relay passes on only batches it checked: a
        bad one is a relay's bug, not a node's)."""
        try:
            relayed = decode_relay_batch(body)
        except SchemaError as exc:
            raise BadRequest(exc.field or "body", exc.reason) from exc
        now = self._clock()
        if isinstance(relayed, Relayed):
            with self._lock:
                taken = self._store_rows(relayed, now)
            reports = [(head.node, head.attempt, head.age_s) for head in relayed.nodes]
        else:
            taken = 0
            with self._lock:
                for item in relayed.nodes:
                    taken += self._store(item.batch, now - item.age_s, relayed.relay)
            reports = [(item.batch.node, item.batch.attempt, item.age_s) for item in relayed.nodes]
        for node, attempt, age_s in reports:
            if attempt is not None:
                self.processes.report(node, attempt, now - age_s)
        return len(relayed.nodes), taken

    def _store(self, batch: HeartbeatBatch, received_at: float, relay: str | None) -> int:
        """Called with the lock held. NOTE: a relay may pass on a node's batch older than the one already here
        (it failed over to the healer and back): the newer one stays."""
        node = batch.node
        held = self._nodes.get(node) if relay is not None else None
        if held is not None and held.received_at > received_at:
            return 0
        beats = tuple([RankBeat(node, received_at, e) for e in batch.ranks])
        max_age = max((e.last_seen_age_s for e in batch.ranks), default=0.0)
        self._nodes.put(NodeBeat(node=node, received_at=received_at, seq=batch.seq, ranks=beats, max_age_s=max_age,
                                 jobs=tuple(sorted({e.job for e in batch.ranks})), gpus=tuple(batch.gpus),
                                 gpus_flagged=any(gpu_flagged(g) for g in batch.gpus),
                                 agent_url=batch.agent_url, relay=relay))
        columns = self._columns
        node_id = columns.node_id(node)
        cols = None
        for beat in beats:
            job = beat.entry.job
            if cols is None or cols.job != job:
                cols = columns.job(job)
            cols.write(beat, node_id)
        self.batches += 1
        self.records += len(beats)
        return len(beats)

    def _store_rows(self, relayed: Relayed, now: float) -> int:
        """Called with the lock held: _store for every node of a relay batch by column. Per rank, only a RankBeat
        that points at its row and the table's key; the numbers go into the columns with numpy."""
        rows, relay = relayed.rows, relayed.relay
        columns = rows.columns
        jobs, job_of = rows.jobs, columns["job"].tolist()
        ages = columns["last_seen_age_s"].tolist()
        nodes, table = self._nodes, self._columns
        n = len(rows)
        row_beats: list[RankBeat | None] = [None] * n
        received = np.full(n, np.nan)
        node_ids = np.zeros(n, dtype=np.int64)
        start = taken = 0
        for head in relayed.nodes:
            stop = start + head.ranks
            received_at = now - head.age_s
            held = nodes.get(head.node)
            if held is None or held.received_at <= received_at:
                node = head.node
                beats = tuple([RankBeat(node, received_at, rows, i) for i in range(start, stop)])
                max_age = max(ages[start:stop], default=0.0)
                nodes.put(NodeBeat(node=node, received_at=received_at, seq=head.seq, ranks=beats, max_age_s=max_age,
                                   jobs=tuple(sorted({jobs[j] for j in job_of[start:stop]})),
                                   gpus=tuple(head.gpus), gpus_flagged=any(gpu_flagged(g) for g in head.gpus),
                                   agent_url=head.agent_url, relay=relay))
                row_beats[start:stop] = beats
                received[start:stop] = received_at
                node_ids[start:stop] = table.node_id(node)
                taken += stop - start
                self.batches += 1
            start = stop
        table.write_rows(rows, received, node_ids, row_beats)
        self.records += taken
        return taken

    def ranks(self) -> list[RankBeat]:
        """A snapshot of every rank's latest heartbeat, by job and then in the order its ranks were first heard (the
        list is a copy; the entries are not changed later). A pass in Python: for tools and tests, not every cycle."""
        with self._lock:
            return [b for cols in self._columns.jobs.values() for b in cols.beats if b is not None]

    def nodes(self) -> list[NodeBeat]:
        with self._lock:
            return self._nodes.beats()

    def saved_steps(self, job: str) -> tuple[int, ...]:
        """The steps of the checkpoints `job`'s ranks said they saved (rank_columns.RankColumns.saved), in order."""
        with self._lock:
            return tuple(sorted(self._columns.saved.get(job, ())))

    def forget_saved_after(self, job: str, step: int) -> None:
        """A rollback to `step` made `job`'s later checkpoints history: they count again only once saved again."""
        with self._lock:
            saved = self._columns.saved.get(job)
            if saved is not None:
                saved.difference_update({s for s in saved if s > step})

    def node_times(self) -> tuple[np.ndarray, np.ndarray]:
        """(received_at, max_age_s) of each node of nodes(), as arrays in its order."""
        with self._lock:
            return self._nodes.times()

    def snapshot(self) -> tuple[list[NodeBeat], tuple[np.ndarray, np.ndarray], dict[str, JobView]]:
        """nodes(), node_times() and columns() of one moment (a detection cycle's view: all agree)."""
        with self._lock:
            return self._nodes.beats(), self._nodes.times(), self._columns.snapshot()

    def columns(self) -> dict[str, JobView]:
        """Per job, a copy of its ranks' columns, every present rank counted (healer/observe/rank_columns.py)."""
        with self._lock:
            return self._columns.snapshot()

    def jobs(self) -> set[str]:
        with self._lock:
            return set(self._columns.jobs)

    def forget_old(self) -> int:
        """Drop ranks and nodes not heard of for forget_after_s (a job long gone); returns how many ranks."""
        cutoff = self._clock() - self._forget_after_s
        with self._lock:
            # NOTE: a pass in Python over every rank: this runs with housekeeping (hourly), not every cycle
            old = [(job, beat.rank) for job, cols in self._columns.jobs.items() for beat in cols.beats
                   if beat is not None and beat.received_at < cutoff]
            self._columns.drop(old)
            self._nodes.forget_before(cutoff)
        return len(old)

    def __len__(self) -> int:
        with self._lock:
            return sum(cols.live() for cols in self._columns.jobs.values())
