"""`heartbeat_stale`: ranks the healer has not heard of for too long, one finding per (job, node).

A rank's staleness is the age of its newest record when its sidecar sent the batch, plus the time since
that batch arrived: a dead sidecar (no batches) and a silent rank behind a live sidecar both show. A node
is firing when at least `min_ranks` of its ranks (in its latest batch) are stale, and healthy when none is.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

import numpy as np

from healer.detect.base import Detector, Evaluation, Finding, LazyKeys
from healer.observe.heartbeats import RankBeat
from healer.observe.jobview import Readings

MAX_LISTED = 32


class HeartbeatStale(Detector):
    name = "heartbeat_stale"
    measures_silence = True

    @dataclass(kw_only=True, slots=True)
    class Config:
        after: timedelta = timedelta(seconds=30)
        """A rank is stale when its newest record is older than this."""
        min_ranks: int = 1
        """A node fires when at least this many of its ranks are stale."""

        def __post_init__(self) -> None:
            if self.after <= timedelta(0):
                raise ValueError(f"after must be > 0, got {self.after}")
            if self.min_ranks < 1:
                raise ValueError(f"min_ranks must be >= 1, got {self.min_ranks}")

    config: Config

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        after = self.config.after.total_seconds()
        firing = []
        healthy: set[str] = set()
        nodes = table.nodes()
        # NOTE: each node's worst staleness (since its batch came, plus its oldest rank record's age then) from the
        # table's arrays of them (healer/observe/nodes.py): a node whose every rank is fresh, nearly all of them,
        # is cleared in numpy; a pass over 16,384 NodeBeats cost ~8 ms a cycle.
        received, max_age = table.node_times()
        fresh = np.maximum(now - received, 0.0) + max_age <= after
        for i in np.flatnonzero(~fresh).tolist():
            node = nodes[i]
            by_job: dict[str, list[RankBeat]] = defaultdict(list)
            for beat in node.ranks:
                by_job[beat.job].append(beat)
            for job, beats in by_job.items():
                key = f"{job}/{node.node}"
                # NOTE: no rank is silent for longer than its attempt has run: the time the healer spent stopping,
                # diagnosing and starting it is its own, not the ranks' (a warm restart's survivors keep their last
                # record from before it).
                _, started_at = table.processes.placement(job)
                most = now - started_at if started_at > 0 else float("inf")
                found = [(b, age) for b in beats if (age := min(b.staleness(now), most)) > after]
                if not found:
                    healthy.add(key)
                elif len(found) >= self.config.min_ranks:
                    firing.append(self._finding(key, job, node.node, found, len(beats)))
        # Healthy: every job of a node none of whose ranks is stale, and the stale nodes' jobs found healthy above.
        return Evaluation(firing=tuple(firing), healthy=LazyKeys(lambda: healthy.union(
            f"{job}/{nodes[i].node}" for i in np.flatnonzero(fresh).tolist() for job in nodes[i].jobs)))

    def _finding(self, key: str, job: str, node: str, found: list[tuple[RankBeat, float]], total: int) -> Finding:
        found.sort(key=lambda item: item[0].rank)
        oldest = max(age for _, age in found)
        ranks = [beat.rank for beat, _ in found]
        shown = ", ".join(map(str, ranks[:MAX_LISTED])) + (", ..." if len(ranks) > MAX_LISTED else "")
        return Finding(
            key=key, job=job, node=node,
            summary=f"{len(found)} of {total} ranks on {node} silent for up to {oldest:.0f} s (ranks {shown})",
            evidence={"after_s": self.config.after.total_seconds(), "stale_ranks": len(found), "ranks_on_node": total,
                      "ranks": [{"rank": b.rank, "staleness_s": round(a, 3), "alive": b.alive, "step": b.step}
                                for b, a in found[:MAX_LISTED]]},
        )
