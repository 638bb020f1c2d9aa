"""`host_lost`: a host of the job's current attempt went silent and the job stopped with it, one finding per
(job, host).

Under a launcher every host runs a node agent that posts a batch every second or so, whatever its ranks do. A host
whose batches stop is dead (power, kernel, every process killed) or cut off from the others (its link is down); its
ranks' peers then fail or wait in a collective that will not complete. Neither shows in a process state the healer
can read (the processes are on the host it cannot reach), so the silence names the host. Two things must both hold,
for `after`:
- no batch from the host (none at all since the attempt started counts from the start);
- no rank of the job advanced its step for `after` / 2: a job that goes on training without the host's reports
  still has the host (only its agent is gone; the runner restarts the agent instead). Not for a job of replica
  groups, one per host (train/ft/): the other groups train on without the lost one, by design.
A link that flaps for less than `after` is no fault: the batches and the steps come back. The host is healthy
again when it reports or when the attempt no longer runs on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from healer.detect.base import Detector, Evaluation, Finding
from healer.detect.suspects import Suspect
from healer.observe.jobview import Readings


@dataclass(slots=True)
class _Progress:
    attempt: int
    step: int
    at: float


class HostLost(Detector):
    name = "host_lost"
    reads_processes = True
    measures_silence = True

    @dataclass(kw_only=True, slots=True)
    class Config:
        after: timedelta = timedelta(seconds=15)
        """Silence of the host, and half of it without a step of the job, before it counts as lost."""

        def __post_init__(self) -> None:
            if self.after <= timedelta(0):
                raise ValueError(f"after must be > 0, got {self.after}")

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._progress: dict[str, _Progress] = {}
        self._fired: dict[str, set[str]] = {}
        """job -> the hosts it fired for: healthy once the job's attempt no longer runs there."""

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        view = table.processes
        after = self.config.after.total_seconds()
        firing, healthy = [], set()
        jobs = view.jobs()
        for job in [j for j in self._progress if j not in jobs]:
            del self._progress[job]
            self._fired.pop(job, None)
        if not jobs:
            return Evaluation()  # no launcher: no attempt placed on hosts to miss one of them
        heard = {n.node: n.received_at for n in table.nodes()}
        steps = {job: int(cols.step[cols.counts].max(initial=-1)) for job, cols in table.columns().items()}
        for job in jobs:
            attempt = view.attempt(job)
            nodes, started_at = view.placement(job)
            if attempt is None or not nodes:
                continue
            progress = self._progress_of(job, attempt, steps.get(job, -1), max(started_at, 0.0), now)
            fired = self._fired.setdefault(job, set())
            for node in fired - set(nodes):
                healthy.add(f"{job}/{node}")  # the attempt no longer runs there
            fired &= set(nodes)
            if view.is_stopping(job):
                continue  # its silence and its standstill are the healer's own doing
            for node in nodes:
                key = f"{job}/{node}"
                last = heard.get(node)
                since = max(last if last is not None else started_at, started_at)
                silent = now - since
                still = now - progress.at
                if silent <= after:
                    if last is not None and last >= started_at:
                        healthy.add(key)
                    continue
                # NOTE: replica groups (one per host) train on without a lost host's: the job's progress says nothing
                # of it, and its own ranks report through its own sidecar, silent with it.
                if still <= after / 2 and not view.in_groups(job):
                    continue  # the job trains on: the host's ranks are there, only its reports are not
                fired.add(node)
                firing.append(self._finding(key, job, node, attempt, last, silent, progress, still, heard, now,
                                            view.in_groups(job)))
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy))

    def _progress_of(self, job: str, attempt: int, step: int, started_at: float, now: float) -> _Progress:
        p = self._progress.get(job)
        if p is None or p.attempt != attempt:
            p = self._progress[job] = _Progress(attempt, step, started_at or now)
        elif step > p.step:
            p.step, p.at = step, now
        return p

    def _finding(self, key: str, job: str, node: str, attempt: int, last: float | None, silent: float,
                 progress: _Progress, still: float, heard: dict[str, float], now: float, grouped: bool) -> Finding:
        when = "since the attempt started" if last is None else f"for {silent:.0f} s"
        what = ("its replica group with it (the other groups train on)" if grouped else
                f"the job stopped with it (no step for {still:.0f} s)")
        return Finding(
            key=key, job=job, node=node,
            summary=f"host {node} silent {when} and {what}: the host is down or cut off from the others",
            evidence={"attempt": attempt, "silent_s": round(silent, 3),
                      "last_heard_age_s": None if last is None else round(now - last, 3),
                      "job_step": progress.step if progress.step >= 0 else None, "no_step_for_s": round(still, 3),
                      "after_s": self.config.after.total_seconds(),
                      "other_hosts_heard_age_s": {n: round(now - t, 3) for n, t in sorted(heard.items()) if n != node}},
            labels={"suspect_node": node},
            suspects=(Suspect(node=node),),
        )
