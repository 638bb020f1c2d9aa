"""One detection cycle's view of the jobs: what the detectors are handed, built once per tick.

The heartbeat table keeps every rank a sidecar still reports, and a sidecar reports a rank of an earlier attempt
until the new attempt's rank of the same number says hello (or for minutes, when the job came back smaller).
Under a launcher only the current attempt counts: the view keeps the heartbeats of the processes the launcher
found for that attempt, and nothing at all of a job whose attempt the healer is stopping (its silence and its
exits are the healer's own doing). Without a launcher (the service alone) every heartbeat counts.

The view has the table's reading interface (`ranks()`, `nodes()`, `jobs()`, `processes`), so a detector reads a
view the way it would read the table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from healer.core.heartbeats import HeartbeatTable, NodeBeat, RankBeat
from healer.core.processes import ProcessView


class Readings(Protocol):
    """What a detector reads: a tick's view (or, in tests of one detector, the heartbeat table itself)."""

    @property
    def processes(self) -> ProcessView: ...

    def ranks(self) -> list[RankBeat]: ...

    def nodes(self) -> list[NodeBeat]: ...


@dataclass(frozen=True, slots=True)
class TickView:
    beats: tuple[RankBeat, ...]
    node_beats: tuple[NodeBeat, ...]
    processes: ProcessView
    histories: object | None = None
    """The healer's HistoryPool (healer/core/detectors/history.py): the detectors' samples, taken once per cycle."""

    @classmethod
    def of(cls, table: HeartbeatTable, histories: object | None = None) -> TickView:
        view = table.processes
        keep: dict[str, frozenset[int] | None] = {}

        def counts(beat: RankBeat) -> bool:
            if beat.job not in keep:
                attempt = view.attempt(beat.job)
                keep[beat.job] = None if attempt is None else (
                    frozenset() if view.is_stopping(beat.job) else view.pids(beat.job))
            pids = keep[beat.job]
            return pids is None or beat.entry.pid in pids

        beats = tuple(b for b in table.ranks() if counts(b))
        nodes = []
        for node in table.nodes():
            ranks = tuple(b for b in node.ranks if counts(b))
            if len(ranks) != len(node.ranks):
                node = replace(node, ranks=ranks, max_age_s=max((b.last_seen_age_s for b in ranks), default=0.0),
                               jobs=tuple(sorted({b.job for b in ranks})))
            nodes.append(node)
        return cls(beats, tuple(nodes), view, histories)

    def ranks(self) -> list[RankBeat]:
        return list(self.beats)

    def nodes(self) -> list[NodeBeat]:
        return list(self.node_beats)

    def jobs(self) -> set[str]:
        return {b.job for b in self.beats}

    def steps(self, job: str) -> list[int]:
        """The steps the job's counted ranks last reported (none yet: empty)."""
        return [b.step for b in self.beats if b.job == job and b.step is not None]
