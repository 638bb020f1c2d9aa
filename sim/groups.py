"""restart: replica in the simulation (sim/engine.py): a job whose data-parallel replicas are replica groups
(train/ft/). A fault the policy answers by replacing a host takes out that host's group only: every GPU waits
`stages.ft_timeout` and the step in flight is tried again without it, the others train on while its incident runs,
and the group's hosts are out (degraded) until a group joins in its place (`stages.group_join`). Mixed into
Simulation; every method works on its state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from healer.decide.catalogue import fault
from healer.decide.plans import JobFacts, replica_reason
from sim.config import Category
from sim.decisions import SimIncident

if TYPE_CHECKING:
    from sim.engine import Simulation


class GroupLosses:
    def _replica(self: Simulation, cat: Category) -> bool:
        return (self.cfg.restart == "replica" and self.segment is not None
                and replica_reason(fault(self._kind(cat)), JobFacts(nodes=(), replica_groups=self.dp)) is not None)

    def _group_of(self: Simulation, host: int) -> list[int]:
        i = self.hosts.index(host) // self.hpr * self.hpr
        return self.hosts[i:i + self.hpr]

    def _lose_group(self: Simulation, host: int, cat: Category) -> None:
        """The host's replica group is gone: every group waits for the collective with it to time out and tries the
        step again without it (ft_timeout, the step in flight lost), then the others train on while its incident
        runs; its hosts are out until a group joins in its place."""
        self._close_training(self.now)
        # NOTE: the step in flight, begun after the newest save at the latest (a save is taken between two steps):
        # that save stays, and the job's saves never all go with one lost step.
        saved = max((p for p, _ in self.durable if p <= self.progress), default=0.0)
        self._lose(max(saved, self.progress - self.cfg.job.step_time.total_seconds()), cat.name)
        group = self._group_of(host)
        self.out |= set(group)
        self._pause(self.cfg.stages.ft_timeout.total_seconds(), cat.name)
        kind = self._kind(cat)
        inc = SimIncident(id=next(self._ids), kind=kind, cause=cat.name, fault_at=self.now, attempt=self.attempt,
                          host=host, degraded=tuple(group))
        self.incidents[kind] += 1
        self._push(self.now + self.detect.get(kind, 0.0), "detected", inc)

    def _regroup(self: Simulation, inc: SimIncident, plan: Any) -> None:
        """The policy's replica restart: the excluded hosts to repair, spares in their place; the group's hosts
        join after group_join (from a live peer, nothing lost); with no spare, the job goes on a group smaller."""
        self.restarts["replica"] += 1
        # NOTE: not in restart_times: a group replaced stops no job, and spends no restart budget (the real store's
        # restart_times leaves mode replica out); the lemon limit bounds a host that keeps failing
        joined = self._take_hosts(inc, plan)
        training = self.segment is not None
        if training:
            self._close_training(self.now)
        elif inc.stopped and self.down is not None and self.down[0] == "diagnosis":
            self._close_down(self.now)  # the job was stopped for this incident's diagnosis: it trains again now
            training = True
        self.hosts = [self._index[n] for n in plan.nodes]
        self.dp = plan.dp or self.dp
        self.out &= set(self.hosts)
        coming = [h for h in self.hosts if h in self.out or h in joined]
        self.out |= set(coming)
        if coming:
            self._push(self.now + self.cfg.stages.group_join.total_seconds(), "joined", tuple(coming))
        if training:
            self._start_training()

    def _stopped_at(self: Simulation, inc: SimIncident) -> float:
        """When the job stopped for `inc`: its fault, or for a group's incident (the others trained on) now."""
        return self.now if inc.degraded else inc.fault_at

    def _on_joined(self: Simulation, hosts: tuple[int, ...]) -> None:
        self.out -= set(hosts)
        if self.segment is not None:
            self._close_training(self.now)
            self._start_training()
