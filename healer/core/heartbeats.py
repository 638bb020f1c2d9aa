"""Heartbeat batches from the node sidecars (exporters/heartbeat.py, schema 1): validation and the
in-memory table of every rank's latest heartbeat that the detectors read.

The stream is kept in memory only: at 12,288 ranks and one batch per node per second, writing each
heartbeat to the database would cost more than the whole healer. What must survive a restart
(incidents, nodes) is written by the engine, not here. Validation checks what the healer reads and
ignores the rest, so a newer sidecar with more fields is still accepted.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from healer.errors import BadRequest
from healer.core.processes import ProcessView

SCHEMA = 1
MAX_RANKS_PER_BATCH = 4096
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,252}$")


@dataclass(slots=True)
class RankBeat:
    """The latest heartbeat of one rank, as the healer keeps it."""

    job: str
    rank: int
    node: str
    received_at: float
    """Healer clock (unix seconds) when the batch carrying it arrived."""
    last_seen_age_s: float
    """How old the rank's newest record was when the sidecar sent the batch."""
    alive: bool
    step: int | None
    data: dict[str, Any]
    """The whole entry as the sidecar sent it, for detectors that read more (phases, loss, ...)."""

    def staleness(self, now: float) -> float:
        """Seconds since this rank last reported a record, as far as the healer can tell."""
        return max(0.0, now - self.received_at) + self.last_seen_age_s


@dataclass(slots=True)
class NodeBeat:
    """A node's latest batch: its ranks, and the age of its oldest rank record, so that a detection cycle can
    clear a healthy node with one comparison instead of looking at each of its ranks."""

    node: str
    received_at: float
    seq: int
    ranks: tuple[RankBeat, ...]
    max_age_s: float
    jobs: tuple[str, ...]
    gpus: tuple[dict[str, Any], ...] = ()
    """The node's GPU health entries as the sidecar sent them (the gpu_fault detector reads them)."""

    def worst_staleness(self, now: float) -> float:
        return max(0.0, now - self.received_at) + self.max_age_s


def parse_batch(body: Any) -> tuple[str, int, list[dict[str, Any]]]:
    """Validate a decoded batch; returns (node, seq, rank entries). BadRequest names the offending field."""
    node, seq, entries, _ = parse_batch_gpus(body)
    return node, seq, entries


def parse_batch_gpus(body: Any) -> tuple[str, int, list[dict[str, Any]], list[dict[str, Any]]]:
    """parse_batch, plus the batch's GPU entries (objects only; each needs an integer `gpu`)."""
    if not isinstance(body, dict):
        raise BadRequest("body", f"expected a JSON object, got {_kind(body)}")
    schema = body.get("schema")
    if schema != SCHEMA:
        raise BadRequest("schema", f"expected {SCHEMA}, got {schema!r}")
    node = _name(body.get("node"), "node")
    seq = body.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise BadRequest("seq", f"expected an integer >= 0, got {seq!r}")
    _number(body.get("sent_at"), "sent_at")
    ranks = body.get("ranks")
    if not isinstance(ranks, list):
        raise BadRequest("ranks", f"expected a list, got {_kind(ranks)}")
    if len(ranks) > MAX_RANKS_PER_BATCH:
        raise BadRequest("ranks", f"at most {MAX_RANKS_PER_BATCH} ranks per batch, got {len(ranks)}")
    entries: list[dict[str, Any]] = []
    for i, entry in enumerate(ranks):
        _check_rank(entry, f"ranks[{i}]")
        entries.append(entry)
    gpus = body.get("gpus", [])
    if not isinstance(gpus, list):
        raise BadRequest("gpus", f"expected a list, got {_kind(gpus)}")
    for i, gpu in enumerate(gpus):
        if not isinstance(gpu, dict) or not isinstance(gpu.get("gpu"), int) or isinstance(gpu.get("gpu"), bool):
            raise BadRequest(f"gpus[{i}]", "expected an object with an integer `gpu`")
    return node, seq, entries, gpus


def _check_rank(entry: Any, where: str) -> None:
    if not isinstance(entry, dict):
        raise BadRequest(where, f"expected an object, got {_kind(entry)}")
    _name(entry.get("job"), f"{where}.job")
    rank = entry.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise BadRequest(f"{where}.rank", f"expected an integer >= 0, got {rank!r}")
    if not isinstance(entry.get("alive"), bool):
        raise BadRequest(f"{where}.alive", f"expected true or false, got {entry.get('alive')!r}")
    if _number(entry.get("last_seen_age_s"), f"{where}.last_seen_age_s") < 0:
        raise BadRequest(f"{where}.last_seen_age_s", "must be >= 0")
    step = entry.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise BadRequest(f"{where}.step", f"expected null or an integer >= 0, got {step!r}")


def _number(value: Any, field: str) -> float:
    if value is None:
        raise BadRequest(field, "missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(field, f"expected a finite number, got {value!r}")
    return float(value)


def _name(value: Any, field: str) -> str:
    if value is None:
        raise BadRequest(field, "missing")
    if not isinstance(value, str) or not NAME.match(value):
        raise BadRequest(field, f"expected a name (letters, digits, . _ : @ / -, at most 253), got {value!r}")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(type(value), type(value).__name__)


class HeartbeatTable:
    """The latest heartbeat of every rank and node. Written by the API, read by the detectors (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.time, forget_after_s: float = 3600.0) -> None:
        if forget_after_s <= 0:
            raise ValueError(f"forget_after_s must be > 0, got {forget_after_s}")
        self._clock = clock
        self._forget_after_s = forget_after_s
        self._ranks: dict[tuple[str, int], RankBeat] = {}
        self._nodes: dict[str, NodeBeat] = {}
        self._lock = threading.Lock()
        self.batches = 0
        self.records = 0
        # NOTE: the supervisor's view (exits, process states) sits beside the heartbeats so that a detector still
        # sees one input; it is empty when no supervisor runs in this healer.
        self.processes = ProcessView()

    def ingest(self, body: Any) -> int:
        """Validate and store one batch; returns the number of rank entries taken. Raises BadRequest."""
        node, seq, ranks, gpus = parse_batch_gpus(body)
        now = self._clock()
        beats = [RankBeat(job=e["job"], rank=e["rank"], node=node, received_at=now,
                          last_seen_age_s=float(e["last_seen_age_s"]), alive=e["alive"], step=e.get("step"), data=e)
                 for e in ranks]
        entry = NodeBeat(node=node, received_at=now, seq=seq, ranks=tuple(beats),
                         max_age_s=max((b.last_seen_age_s for b in beats), default=0.0),
                         jobs=tuple(sorted({b.job for b in beats})), gpus=tuple(gpus))
        with self._lock:
            for beat in beats:
                self._ranks[(beat.job, beat.rank)] = beat
            self._nodes[node] = entry
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
            for name in [n for n, b in self._nodes.items() if b.received_at < cutoff]:
                del self._nodes[name]
        return len(old)

    def __len__(self) -> int:
        return len(self._ranks)
