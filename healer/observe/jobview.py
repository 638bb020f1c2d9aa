"""One detection cycle's view of the jobs: what the detectors are handed, built once per tick.

The heartbeat table keeps every rank a sidecar still reports, and a sidecar reports a rank of an earlier attempt
until the new attempt's rank of the same number says hello (or for minutes, when the job came back smaller).
Under a launcher only the current attempt counts: the view keeps the heartbeats of the processes the launcher
found for that attempt, and nothing at all of a job whose attempt the healer is stopping (its silence and its
exits are the healer's own doing). A warm restart keeps the processes, so a rank's step also says which attempt it
belongs to (RankEntry.attempt): a step of another attempt does not count (one the aborted attempt finished after
the next was planned, a NaN of the weights the rollback threw away). Without a launcher (the service alone) every
heartbeat counts.

The view has the table's reading interface (`ranks()`, `nodes()`, `columns()`, `jobs()`, `processes`), so a
detector reads a view the way it would read the table. `columns()` is the same ranks as arrays per job
(healer/observe/rank_columns.py): what a detector that looks at every rank each cycle computes over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
from msgspec.structs import replace

from healer.observe.heartbeats import HeartbeatTable, NodeBeat, RankBeat
from healer.observe.processes import ProcessView
from healer.observe.rank_columns import JobView

if TYPE_CHECKING:  # NOTE: history.py reads views: it imports this module
    from healer.observe.history import HistoryPool


class Readings(Protocol):
    """What a detector reads: a tick's view (or, in tests of one detector, the heartbeat table itself)."""

    @property
    def processes(self) -> ProcessView: ...

    def ranks(self) -> list[RankBeat]: ...

    def nodes(self) -> list[NodeBeat]: ...

    def node_times(self) -> tuple[np.ndarray, np.ndarray]: ...

    def columns(self) -> dict[str, JobView]: ...

    @property
    def histories(self) -> HistoryPool | None:
        """The detectors' shared samples, taken once per cycle (None: each learning detector keeps its own)."""



@dataclass(frozen=True, slots=True, weakref_slot=True)
class TickView:
    """One detection cycle's snapshot, the one type every detector is handed. The ranks are their jobs' columns
    (`job_columns`: numbers as arrays, and each slot's RankBeat), counted as the launcher says; the nodes their
    latest batches; the history the detectors share a typed field of it."""

    node_beats: tuple[NodeBeat, ...]
    processes: ProcessView
    job_columns: dict[str, JobView] = field(default_factory=dict)
    """Per job, its ranks' columns, counting what `beats` holds."""
    histories: HistoryPool | None = None
    """The healer's HistoryPool (healer/observe/history.py): the detectors' samples, taken once per cycle."""
    node_received: np.ndarray = field(default_factory=lambda: np.zeros(0))
    node_max_age: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Each of node_beats' received_at and max_age_s, as arrays (healer/observe/nodes.py)."""

    @classmethod
    def of(cls, table: HeartbeatTable, histories: HistoryPool | None = None) -> TickView:
        view = table.processes
        # job -> the pids that count (empty: none, the attempt is being stopped), for the jobs a launcher started.
        # Every other job's heartbeats all count.
        keep = {job: frozenset() if view.is_stopping(job) else view.pids(job) for job in view.jobs()}
        attempts = {job: view.attempt(job) for job in keep}
        node_beats, (received, max_age), job_columns = table.snapshot()
        if not keep:
            # NOTE: the service alone (no launcher): nothing to filter. Filtering 131,072 ranks one by one took most
            # of a detection cycle (~165 ms of 186 ms, bench/healer_ingest.py).
            return cls(tuple(node_beats), view, job_columns, histories, received, max_age)

        def counts(beat: RankBeat) -> bool:
            pids = keep.get(beat.job)
            if pids is None:
                return True
            said = beat.attempt
            return beat.pid in pids and (said is None or said == attempts[beat.job])

        nodes = []
        for i, node in enumerate(node_beats):
            if not any(job in keep for job in node.jobs):
                nodes.append(node)  # none of its ranks belongs to a launched job: all count
                continue
            kept = tuple(b for b in node.ranks if counts(b))
            if len(kept) != len(node.ranks):
                node = replace(node, ranks=kept, max_age_s=max((b.last_seen_age_s for b in kept), default=0.0),
                               jobs=tuple(sorted({b.job for b in kept})))
                max_age[i] = node.max_age_s  # NOTE: the snapshot's own copy
            nodes.append(node)
        columns = {}
        for job, cols in job_columns.items():
            pids = keep.get(job)
            if pids is None:
                columns[job] = cols
            elif pids:
                said = cols.attempt
                columns[job] = cols.only(np.isin(cols.pid, np.fromiter(pids, dtype=np.int64, count=len(pids)))
                                         & ((said < 0) | (said == attempts[job])))
        return cls(tuple(nodes), view, columns, histories, received, max_age)

    def ranks(self) -> list[RankBeat]:
        """The ranks that count in this cycle (a pass in Python: for evidence and tools, not every cycle)."""
        return [b for cols in self.job_columns.values() for b in cols.counted_beats()]

    def nodes(self) -> list[NodeBeat]:
        return list(self.node_beats)

    def node_times(self) -> tuple[np.ndarray, np.ndarray]:
        return self.node_received, self.node_max_age

    def columns(self) -> dict[str, JobView]:
        return self.job_columns

    def jobs(self) -> set[str]:
        """The jobs with a rank that counts in this cycle."""
        return {job for job, cols in self.job_columns.items() if cols.counts.any()}

    def steps(self, job: str) -> list[int]:
        """The steps the job's counted ranks last reported (none yet: empty)."""
        cols = self.job_columns.get(job)
        return [] if cols is None else [int(s) for s in cols.step[cols.counts] if s >= 0]
