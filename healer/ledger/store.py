"""The goodput ledger of a run, written into the healer's database (`goodput_intervals`) while the run goes on,
so the dashboards' ETTR, lost-work and restart panels have data: the run's intervals (healer.ledger.goodput) replace
the rows of its wall time each time, in one transaction (idempotent; other runs of the same job keep theirs).
Called off the healing loop (the loop's background thread): writing a long run's ledger takes a while.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy.engine import Engine

from healer.incidents.jobstore import IntervalRow, JobStore
from healer.incidents.timeline import job_timelines
from healer.ledger.goodput import intervals


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


class LedgerWriter:
    def __init__(self, run_dir: Path, engine: Engine, job: str) -> None:
        self.run_dir, self.engine, self.job = run_dir, engine, job
        self.jobs = JobStore(engine)

    def write(self) -> int:
        """Write the ledger as it stands; returns the number of intervals (0 before the first attempt)."""
        incidents = [t.to_payload() for t in job_timelines(self.engine, self.job)]
        spans = intervals(self.run_dir, incidents)
        if not spans:
            return 0
        # NOTE: an interval shorter than the database's microsecond is dropped: it could repeat a start.
        rows = [IntervalRow(kind=s.kind, started_at=start, ended_at=end, incident_id=s.incident, steps=s.steps)
                for s in spans if (start := _utc(s.start)) < (end := _utc(s.end))]
        self.jobs.replace_intervals(self.job, _utc(spans[0].start), _utc(spans[-1].end), rows)
        return len(rows)
