"""Synthetic heartbeat streams: a job of ranks on nodes stepping in lockstep, with per-rank phase timings the
tests shape (a slow rank, a late rank, a slow network, a NaN, a spike), fed through the real HeartbeatTable
ingest path, one batch per node per tick, the way exporters/heartbeat.py sends them."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from healer.observe.heartbeats import HeartbeatTable

Phases = dict[str, float]


@dataclass
class JobStream:
    table: HeartbeatTable
    clock: Any
    nodes: dict[str, list[int]]
    job: str = "job"
    step: int = 0
    seed: int = 0
    compute: float = 0.2
    transfer: float = 0.02
    shape: Callable[[int, int], Phases] | None = None
    """(rank, step) -> phase overrides for that rank and step."""
    loss: Callable[[int], float] = lambda step: 4.0 - 0.01 * step
    late: dict[int, float] = field(default_factory=dict)
    """rank -> seconds it reaches the reduce late outside any timed phase (descheduled, a stray sleep)."""
    silent: set[str] = field(default_factory=set)
    """Nodes whose batches do not arrive (the host is down or cut off, or its agent is gone)."""
    nonfinite_at: dict[int, set[int]] = field(default_factory=dict)
    """step -> ranks whose loss is NaN at that step."""
    stopped: set[int] = field(default_factory=set)
    """Ranks whose process the sidecar reads as stopped (kernel state T); the others are sleeping (S)."""
    mesh: Callable[[int, int], dict[str, int]] | None = None
    """(rank, world size) -> the rank's mesh coordinates; by default every rank is a data-parallel peer."""
    clock_skew: float | None = None
    """Seconds the ranks' hosts' clocks are off the healer's: each step then says when it ended by their clock
    (None: the steps say nothing of their time)."""
    attempt: int | None = None
    """The attempt each step says it is of (None: the steps do not say)."""
    events: dict[int, dict[str, Any]] = field(default_factory=dict)
    """rank -> the last event its next batch carries ({"name": ..., "time": ..., "fields": {...}}), sent once."""
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def phases(self, rank: int, step: int) -> Phases:
        jitter = 1 + self.rng.uniform(-0.03, 0.03)
        p = {"data_wait": 0.002, "forward_backward": self.compute * 0.8 * jitter, "dp_reduce": self.transfer,
             "grad_norm_clip": 0.005, "optimizer": self.compute * 0.2 * jitter}
        if self.shape is not None:
            p.update(self.shape(rank, step))
        return p

    def advance(self, steps: int = 1, seconds: float = 1.0) -> None:
        """`steps` more steps done by every rank, then one batch per node, `seconds` later."""
        self.step += steps
        self.clock.now += seconds
        self.send()

    def send(self, age: float = 0.1, only: set[int] | None = None, gpus: dict[str, list[dict[str, Any]]] | None = None
             ) -> None:
        ranks = {r: self.phases(r, self.step) for rs in self.nodes.values() for r in rs}
        # Everyone waits in the reduce for the slowest rank to arrive: that wait is part of their dp_reduce.
        arrive = {r: p["data_wait"] + p["forward_backward"] + self.late.get(r, 0.0) for r, p in ranks.items()}
        last = max(arrive.values())
        for r, p in ranks.items():
            p["dp_reduce"] += last - arrive[r]
        world = sum(len(v) for v in self.nodes.values())
        for node, rs in self.nodes.items():
            if node in self.silent:
                continue
            entries = []
            for r in rs:
                if only is not None and r not in only:
                    continue
                bad = r in self.nonfinite_at.get(self.step, set())
                loss = self.loss(self.step)
                entries.append({
                    "job": self.job, "rank": r, "pid": 1000 + r, "local_rank": r % len(rs), "world_size": world,
                    "mesh": self.mesh(r, world) if self.mesh else {"pp": 1, "dp": world, "tp": 1}, "alive": True, "last_seen_age_s": age, "dropped": 0,
                    "events": {}, "last_event": self.events.pop(r, None), "step": self.step, "step_seconds": sum(ranks[r].values()) + self.late.get(r, 0.0),
                    "phases": ranks[r], "loss": None if bad else loss, "grad_norm": 1.0,
                    "nonfinite": {"loss": "nan"} if bad else {}, "dp_reduce_lag_s": None,
                    "proc_state": "T" if r in self.stopped else "S",
                    **({"step_time": self.clock.now + self.clock_skew} if self.clock_skew is not None else {}),
                    **({"attempt": self.attempt} if self.attempt is not None else {})})
                assert math.isfinite(loss)
            self.table.ingest({"schema": 1, "node": node, "seq": self.step, "sent_at": self.clock.now,
                               "nvml": "ok" if gpus else "absent", "ranks": entries,
                               "gpus": (gpus or {}).get(node, [])})
