"""The simulated job's incidents put to the healer's own policy (`healer.decide.policy.decide`), with the same facts the
responder gives it in a real run (healer/engine/respond.py: `facts`, `_job_now`): the rule and its budget, the
suspects, the verdict, the hosts, spares and checkpoints, the restarts in the budget's window and each host's
incident history for the lemon limit."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from healer.decide.plans import JobFacts, Verdict
from healer.decide.policy import Decision, JobNow, decide, facts_of
from healer.decide.rules import DetectorCondition, Rule, RuleSet
from healer.decide.states import IncidentState

EPOCH = datetime(2026, 1, 1)
"""Simulated time 0 as the policy's clock reads it."""


def at(seconds: float) -> datetime:
    return EPOCH + timedelta(seconds=seconds)


@dataclass(slots=True)
class SimIncident:
    id: int
    kind: str
    cause: str
    """The failure category behind it (the record's line)."""
    host: int | None
    """The host the detector names; None when it names none (a NaN)."""
    fault_at: float
    attempt: int
    first_bad_step: int | None = None
    state: IncidentState = IncidentState.OPEN
    state_since: float = 0.0
    verdict: Verdict | None = None
    stopped: bool = False
    """The attempt was stopped for the diagnosis (a cold restart then need not stop it)."""
    degraded: tuple[int, ...] = ()
    suspect_ranks: tuple[int, ...] = ()
    """A hang's: the ranks the hang attribution names as holding the job up (healer/detect/hang_attribution.py):
    the suspect host's."""
    """restart: replica: the hosts of the replica group it took out; the others train on meanwhile."""
    decisions: list[str] = field(default_factory=list)


@dataclass(slots=True)
class JobSnapshot:
    """The simulated job as the launcher would describe it."""

    nodes: tuple[str, ...]
    spares: tuple[str, ...]
    dp: int
    checkpoint_steps: tuple[int, ...]
    restarts: tuple[float, ...]
    node_incidents: dict[str, int]
    attempt: int
    warm_unavailable: str | None
    replica_groups: int = 0
    """restart: replica: the data-parallel replicas, each a replica group (JobFacts.replica_groups)."""
    replica_hosts: dict[str, str] = field(default_factory=dict)
    """restart: warm: the host keeping each host's snapshot replicas (JobFacts.replica_hosts)."""
    unnamed_restarts: tuple[float, ...] = ()
    """Those of `restarts` for a fault that names no host (JobFacts.unnamed_restarts)."""


def rule_for(rules: RuleSet, kind: str) -> Rule | None:
    for rule in rules.rules:
        if isinstance(rule.condition, DetectorCondition) and rule.condition.detector == kind:
            return rule
    return None


def decide_incident(inc: SimIncident, rules: RuleSet, job: JobSnapshot, names: list[str], now: float) -> Decision:
    """What the policy decides for `inc` now."""
    rule = rule_for(rules, inc.kind)
    window = rules.budget(rule).window.total_seconds()
    facts = JobFacts(nodes=job.nodes, spares=job.spares, dp=job.dp, checkpoint_steps=job.checkpoint_steps,
                     restarts=tuple(at(t) for t in job.restarts if now - t < window),
                     unnamed_restarts=tuple(at(t) for t in job.unnamed_restarts if now - t < window),
                     node_incidents=job.node_incidents, warm_unavailable=job.warm_unavailable,
                     replica_groups=job.replica_groups, replica_hosts=job.replica_hosts)
    return decide(facts_of(incident_id=inc.id, kind=inc.kind, state=inc.state, state_since=at(inc.state_since),
                           now=at(now), rule=rule, rules=rules,
                           suspects=(names[inc.host],) if inc.host is not None else (), attempt=inc.attempt,
                           first_bad_step=inc.first_bad_step, verdict=inc.verdict, suspect_ranks=inc.suspect_ranks,
                           job=JobNow(facts=facts,
                                                                                             attempt=job.attempt)))
