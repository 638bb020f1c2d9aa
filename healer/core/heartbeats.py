"""Heartbeat batches from the node sidecars (exporters/schema.py's HeartbeatBatch, schema 1): decoding, and the
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

from msgspec import Struct

from exporters.schema import (GpuEntry, HeartbeatBatch, RankEntry, SchemaError, convert_batch, decode_batch,
                              decode_relay_batch)
from healer.errors import BadRequest
from healer.core.processes import ProcessView
from healer.core.rank_columns import JobView, RankColumns


# NOTE: msgspec Structs with gc=False, not dataclasses: the table holds one RankBeat per rank and replaces all of
# them every second. As objects the garbage collector tracks, 131,072 of them made it run a full collection (~90 ms)
# about three times a second, ~40% of the healer's time (bench/healer_ingest.py). They hold no reference cycles
# (strings, numbers and the sidecar's own gc=False structs), so the collector need not look at them.
class RankBeat(Struct, frozen=True, gc=False):
    """The latest heartbeat of one rank, as the healer keeps it: the sidecar's typed entry and where and when
    it arrived."""

    node: str
    received_at: float
    """Healer clock (unix seconds) when the batch carrying it arrived."""
    entry: RankEntry
    """The rank's entry as the sidecar sent it (step, phases, loss, pid, last event, ...)."""

    @property
    def job(self) -> str:
        return self.entry.job

    @property
    def rank(self) -> int:
        return self.entry.rank

    @property
    def alive(self) -> bool:
        return self.entry.alive

    @property
    def step(self) -> int | None:
        return self.entry.step

    @property
    def last_seen_age_s(self) -> float:
        """How old the rank's newest record was when the sidecar sent the batch."""
        return self.entry.last_seen_age_s

    def staleness(self, now: float) -> float:
        """Seconds since this rank last reported a record, as far as the healer can tell."""
        return max(0.0, now - self.received_at) + self.entry.last_seen_age_s


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

    def worst_staleness(self, now: float) -> float:
        return max(0.0, now - self.received_at) + self.max_age_s


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
    """The latest heartbeat of every rank and node. Written by the API, read by the detectors (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.time, forget_after_s: float = 3600.0) -> None:
        if forget_after_s <= 0:
            raise ValueError(f"forget_after_s must be > 0, got {forget_after_s}")
        self._clock = clock
        self._forget_after_s = forget_after_s
        self._ranks: dict[tuple[str, int], RankBeat] = {}
        self._nodes: dict[str, NodeBeat] = {}
        self._columns = RankColumns()
        """The same ranks' numbers as arrays per job (healer/core/rank_columns.py): what a detection cycle reads."""
        self._lock = threading.Lock()
        self.batches = 0
        self.records = 0
        # NOTE: the supervisor's view (exits, process states) sits beside the heartbeats so that a detector still
        # sees one input; it is empty when no supervisor runs in this healer.
        self.processes = ProcessView()

    def ingest(self, body: bytes | HeartbeatBatch | Any) -> int:
        """Decode (see parse_batch) and store one batch; returns the number of rank entries taken. Raises BadRequest."""
        batch = parse_batch(body)
        now = self._clock()
        with self._lock:
            taken = self._store(batch, now, None)
        if batch.attempt is not None:
            self.processes.report(batch.node, batch.attempt, now)
        return taken

    def ingest_relayed(self, body: bytes) -> tuple[int, int]:
        """Decode and store a relay's batch (exporters/schema.py's RelayBatch): each node's batch as if it had come
        `age_s` before now. Returns (nodes, rank entries) taken. Raises BadRequest naming the field, and then
        stores none of it (a relay passes on only batches it checked: a bad one is a relay's bug, not a node's)."""
        try:
            relayed = decode_relay_batch(body)
        except SchemaError as exc:
            raise BadRequest(exc.field or "body", exc.reason) from exc
        now = self._clock()
        taken = 0
        with self._lock:
            for item in relayed.nodes:
                taken += self._store(item.batch, now - item.age_s, relayed.relay)
        for item in relayed.nodes:
            if item.batch.attempt is not None:
                self.processes.report(item.batch.node, item.batch.attempt, now - item.age_s)
        return len(relayed.nodes), taken

    def _store(self, batch: HeartbeatBatch, received_at: float, relay: str | None) -> int:
        """Called with the lock held. NOTE: a relay may pass on a node's batch older than the one already here
        (it failed over to the healer and back): the newer one stays."""
        node = batch.node
        held = self._nodes.get(node) if relay is not None else None
        if held is not None and held.received_at > received_at:
            return 0
        beats = tuple([RankBeat(node, received_at, e) for e in batch.ranks])
        self._nodes[node] = NodeBeat(node=node, received_at=received_at, seq=batch.seq, ranks=beats,
                                     max_age_s=max((e.last_seen_age_s for e in batch.ranks), default=0.0),
                                     jobs=tuple(sorted({e.job for e in batch.ranks})), gpus=tuple(batch.gpus),
                                     gpus_flagged=any(gpu_flagged(g) for g in batch.gpus),
                                     agent_url=batch.agent_url, relay=relay)
        ranks, columns = self._ranks, self._columns
        node_id = columns.node_id(node)
        cols = None
        for beat in beats:
            job = beat.entry.job
            ranks[(job, beat.entry.rank)] = beat
            if cols is None or cols.job != job:
                cols = columns.job(job)
            cols.write(beat, node_id)
        self.batches += 1
        self.records += len(beats)
        return len(beats)

    def ranks(self) -> list[RankBeat]:
        """A snapshot of every rank's latest heartbeat (the list is a copy; the entries are not changed later)."""
        with self._lock:
            return list(self._ranks.values())

    def nodes(self) -> list[NodeBeat]:
        with self._lock:
            return list(self._nodes.values())

    def snapshot(self) -> tuple[list[RankBeat], list[NodeBeat], dict[str, JobView]]:
        """ranks(), nodes() and columns() of one moment (a detection cycle's view: all three agree)."""
        with self._lock:
            return list(self._ranks.values()), list(self._nodes.values()), self._columns.snapshot()

    def columns(self) -> dict[str, JobView]:
        """Per job, a copy of its ranks' columns, every present rank counted (healer/core/rank_columns.py)."""
        with self._lock:
            return self._columns.snapshot()

    def jobs(self) -> set[str]:
        with self._lock:
            return {job for job, _ in self._ranks}

    def forget_old(self) -> int:
        """Drop ranks and nodes not heard of for forget_after_s (a job long gone); returns how many ranks."""
        cutoff = self._clock() - self._forget_after_s
        with self._lock:
            old = [key for key, beat in self._ranks.items() if beat.received_at < cutoff]
            for key in old:
                del self._ranks[key]
            self._columns.drop(old)
            for name in [n for n, b in self._nodes.items() if b.received_at < cutoff]:
                del self._nodes[name]
        return len(old)

    def __len__(self) -> int:
        return len(self._ranks)
