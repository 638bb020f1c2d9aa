"""`megaheal run`'s live view: the current attempt's ranks and the newest incidents, redrawn with rich. The
incidents are read back from the store at most once a second (the loop ticks four times as often)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from healer.incidents.timeline import IncidentTimeline
from healer.runner.chaos import Chaos
from healer.runner.loop import SelfHealingJob


class LiveView:
    def __init__(self, job: SelfHealingJob, chaos: Chaos | None, every_s: float = 1.0) -> None:
        self.job, self.chaos, self.every_s = job, chaos, every_s
        self._live: Any = None
        self._incidents: list[IncidentTimeline] = []
        self._read_at = 0.0

    @contextmanager
    def live(self) -> Iterator[None]:
        from rich.live import Live

        with Live(self.render(), refresh_per_second=2) as live:
            self._live = live
            try:
                yield
            finally:
                self._live = None

    def refresh(self) -> None:
        if self._live is not None:
            self._live.update(self.render())

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        job = self.job
        a = job.sup.attempt
        r = job.remediator
        ranks = Table(title=f"attempt {a.number if a else '-'} on {', '.join(r.nodes)} (dp {r.dp})")
        for col in ("rank", "node", "step", "loss", "step s", "state"):
            ranks.add_column(col)
        states = {s.rank: s.state for s in job.table.processes.states()}
        pids = set(a.ranks) if a else set()
        for b in sorted(job.table.ranks(), key=lambda b: b.rank):
            if b.pid not in pids:
                continue
            loss, secs = b.entry.loss, b.entry.step_seconds
            ranks.add_row(str(b.rank), b.node, str(b.step), f"{loss:.4f}" if isinstance(loss, float) else "nan",
                          f"{secs:.2f}" if isinstance(secs, float) else "-", states.get(b.rank, "?"))
        incidents = Table(title="incidents")
        for col in ("#", "kind", "suspect", "verdict", "action", "state", "what happened"):
            incidents.add_column(col)
        for inc in self._read()[-8:]:
            suspect = ", ".join([*(f"rank {x}" for x in inc.suspect_ranks), *inc.suspect_nodes]) or "-"
            incidents.add_row(str(inc.id), inc.kind, suspect, inc.verdict or "-", inc.action or "-", inc.state,
                              inc.summary[:70])
        pending = f"chaos: {len(self.chaos.pending)} fault(s) to come" if self.chaos else "chaos: off"
        return Group(ranks, incidents, pending)

    def _read(self) -> list[IncidentTimeline]:
        now = time.monotonic()
        if now - self._read_at >= self.every_s:
            self._read_at = now
            try:
                self._incidents = self.job.incidents()
            except Exception:  # noqa: BLE001 - NOTE: the view shows what it last read; the loop logs database errors
                pass
        return self._incidents
