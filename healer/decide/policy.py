"""The healer's one policy: a pure function from the frozen facts of an incident to what happens next.

    open         another incident of the job is being remediated            -> wait for it
                 the job has moved on to a later attempt (another restart answered this fault) -> resolve
                 a crash loop: the program failed the same way in an earlier attempt, on two hosts or more
                 (healer.decide.plans.crash_loop)                            -> escalate, stop the job
                 a runbook diagnoses it first (the rule names one; the catalogue diagnoses this kind's suspects
                 first, or the healer runs runbooks locally)                 -> diagnose (diagnosing)
                 otherwise                                                   -> choose the remedy (below)
    diagnosing   the verdict is in                                           -> choose the remedy
                 past the diagnosis deadline                                 -> escalate
    remediating  past the recovery deadline                                  -> escalate
    otherwise    wait: a person owns it, or it is over

A straggler that would cost more before the job ends than a swap (healer.decide.fail_slow) is replaced with a spare
instead of notified, once a checkpoint newer than its naming is saved (it waits for that checkpoint).

Choosing the remedy (healer.decide.plans.choose) gives notify (remediating: told, waiting for the condition to
clear), escalate, or a restart (remediating: restarted, waiting for the new attempt to train); a restart due
later (backoff) waits. Without a launcher nothing can restart the job: the remedy becomes notify, said in the
basis. Every decision carries its basis: the rule, the facts, the verdict, the budget and the deadline.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from healer.decide.catalogue import FaultKind, Remedy, fault
from healer.decide.fail_slow import Slowdown, swap_or_bear
from healer.decide.plans import (
    JobFacts,
    Limits,
    Plan,
    ProgramFailure,
    RestartBudget,
    Verdict,
    choose,
    crash_loop,
    replica_reason,
    restart_mode,
    warm_reason,
)
from healer.decide.rules import Rule, RuleSet
from healer.decide.states import IncidentState

S = IncidentState
BUSY_RETRY = timedelta(seconds=1)
"""How soon an incident that waits for another one's remediation is looked at again."""
CHECKPOINT_RETRY = timedelta(seconds=2)
"""How soon a swap that waits for its checkpoint looks again."""
LIVE_RUNBOOK = "node-health-live"
"""The diagnosis before a warm restart (runbooks/library/node-health-live.yaml): the suspect host's checks that
leave its running processes alone."""


class Action(str, enum.Enum):
    DIAGNOSE = "diagnose"
    REMEDIATE = "remediate"
    ESCALATE = "escalate"
    RESOLVE = "resolve"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class JobNow:
    """The job as the launcher sees it now (None in IncidentFacts: no launcher, the service alone)."""

    facts: JobFacts
    attempt: int | None
    """The attempt running (or last started) now."""
    busy_with: int | None = None
    """Another incident of the job whose diagnosis or restart is in flight: one remediation at a time."""


@dataclass(frozen=True, slots=True)
class IncidentFacts:
    """What a decision may look at."""

    incident_id: int
    kind: FaultKind
    state: IncidentState
    state_since: datetime
    now: datetime
    rule: Rule | None
    """The incident's rule as configured now; None when it is no longer configured."""
    limits: Limits = field(default_factory=Limits)
    budget: RestartBudget = field(default_factory=RestartBudget)
    suspects: tuple[str, ...] = ()
    """Hosts the detector named."""
    suspect_ranks: tuple[int, ...] = ()
    """Ranks the detector (or a hang's look at the ranks) named."""
    stuck_hosts: tuple[str, ...] = ()
    """Hosts whose named rank the kernel holds (state D): no process of theirs can be replaced there."""
    attempt: int | None = None
    """The attempt the fault happened in."""
    first_bad_step: int | None = None
    """For rollbacks: the first step with the bad value."""
    verdict: Verdict | None = None
    """The incident's finished diagnosis, if any."""
    diagnosis_available: bool = False
    """Whether this healer can run the rule's runbook."""
    job: JobNow | None = None
    failure: ProgramFailure | None = None
    """A crash's failure of the program (its signature), when the log names one."""
    slowdown: Slowdown | None = None
    """What a straggler costs each step, from its evidence (kinds that swap_slow)."""


def facts_of(*, incident_id: int, kind: str, state: IncidentState, state_since: datetime, now: datetime,
             rule: Rule | None, rules: RuleSet, suspects: tuple[str, ...], attempt: int | None,
             first_bad_step: int | None, verdict: Verdict | None, job: JobNow | None,
             diagnoser: bool = False, suspect_ranks: tuple[int, ...] = (),
             stuck_hosts: tuple[str, ...] = (), failure: ProgramFailure | None = None,
             slowdown: Slowdown | None = None) -> IncidentFacts:
    """An incident's facts as the policy takes them, from the responder (healer/engine/respond.py) and the simulator
    (sim/decisions.py) alike. `job`: the job as its launcher sees it (None: no launcher acts on it); `diagnoser`:
    without a launcher, whether this healer can still run the rule's runbook."""
    fk = fault(kind)
    if job is not None:
        # A runbook across the job's hosts needs no suspect (a collective slowdown names none) and runs beside the
        # training; one per host runs where the kind's suspects are diagnosed first.
        across = rule is not None and rule.runbook_scope == "job" and len(job.facts.nodes) > 1
        diagnosable = across or (fk.diagnose_first and bool(set(suspects) & set(job.facts.nodes)))
    else:
        diagnosable = diagnoser
    return IncidentFacts(incident_id=incident_id, kind=fk, state=state, state_since=state_since, now=now, rule=rule,
                         limits=rules.limits, budget=rules.budget(rule), suspects=suspects,
                         suspect_ranks=suspect_ranks, stuck_hosts=stuck_hosts, attempt=attempt,
                         first_bad_step=first_bad_step, verdict=verdict if state is IncidentState.DIAGNOSING else None,
                         diagnosis_available=diagnosable, job=job, failure=failure, slowdown=slowdown)


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    to_state: IncidentState | None
    basis: dict[str, Any] = field(default_factory=dict)
    """Why: the rule, the facts and the deadline that made the call."""
    next_action_at: datetime | None = None
    """When to look at the incident again; None: only when something happens to it."""
    plan: Plan | None = None
    """REMEDIATE (and a plan's ESCALATE): what to do, with the plan's own basis."""
    stop_job: bool = False
    """The job cannot go on and will not be restarted: stop it (an escalation of a fault that stopped it)."""

    def to_payload(self) -> dict[str, Any]:
        return {"action": self.action.value, "to_state": self.to_state.value if self.to_state else None,
                "basis": self.basis, "plan": self.plan.to_payload() if self.plan else None,
                "stop_job": self.stop_job,
                "next_action_at": self.next_action_at.isoformat() if self.next_action_at else None}


def decide(f: IncidentFacts) -> Decision:
    rule = f.rule
    if f.state not in (S.OPEN, S.DIAGNOSING, S.REMEDIATING):
        return Decision(Action.WAIT, None, {"reason": f"{f.state.value}: a person owns it or it is over"})
    if rule is None:
        return Decision(Action.ESCALATE, S.ESCALATED, {"reason": "its rule is no longer configured"})
    basis: dict[str, Any] = {"rule": rule.name, "remediate": rule.remediate or f"{f.kind.remedy.value} (catalogue)",
                             "runbook": rule.runbook}
    if f.state is S.OPEN:
        return _open(f, rule, basis)
    if f.state is S.DIAGNOSING:
        if f.verdict is not None:
            return _remedy(f, rule, basis)
        deadline = f.state_since + rule.diagnosis_deadline
        if f.now >= deadline:
            return Decision(Action.ESCALATE, S.ESCALATED, basis | {
                "reason": "no verdict from the diagnosis within its deadline",
                "deadline_s": rule.diagnosis_deadline.total_seconds()}, stop_job=f.kind.stops_job and f.job is not None)
        return Decision(Action.WAIT, None, basis | {"reason": "diagnosing"}, deadline)
    deadline = f.state_since + rule.recovery_deadline
    if f.now >= deadline:
        return Decision(Action.ESCALATE, S.ESCALATED, basis | {
            "reason": "the condition did not clear within the recovery deadline",
            "deadline_s": rule.recovery_deadline.total_seconds()})
    return Decision(Action.WAIT, None, basis | {"reason": "waiting for the condition to clear"}, deadline)


def _open(f: IncidentFacts, rule: Rule, basis: dict[str, Any]) -> Decision:
    job = f.job
    if job is not None and job.busy_with is not None:
        return Decision(Action.WAIT, None, basis | {"reason": f"incident {job.busy_with} of the job is being "
                                                              "remediated: one remediation at a time"},
                        f.now + BUSY_RETRY)
    if job is not None and f.attempt is not None and job.attempt is not None and job.attempt > f.attempt:
        return Decision(Action.RESOLVE, S.RESOLVED, basis | {
            "reason": f"superseded: the job was restarted (attempt {job.attempt}) after the attempt this fault "
                      f"happened in ({f.attempt})"})
    loop = crash_loop(f.failure, job.facts) if job is not None else None
    if loop is not None:
        # NOTE: before any diagnosis: no host is at fault, and the job is stopped for good (one page, this one).
        return Decision(Action.ESCALATE, S.ESCALATED, basis | {"reason": loop.pop("reason"), "crash_loop": loop},
                        stop_job=True)
    # NOTE: a job whose other processes train on through the remedy (warm, or replica groups) must not be stopped for
    # the diagnosis either
    warm = (warm_reason(f.kind, job.facts) or replica_reason(f.kind, job.facts)) if job is not None else None
    if rule.runbook and f.diagnosis_available and warm is None:
        return Decision(Action.DIAGNOSE, S.DIAGNOSING, basis | {"reason": f"run runbook {rule.runbook}"},
                        f.now + rule.diagnosis_deadline)
    if rule.runbook and f.diagnosis_available:
        # NOTE: the rule's runbook wants the host idle, and stopping the job would end the warm pool the restart
        # needs: only the checks that leave the survivors running (a failure makes the restart cold, without the host).
        return Decision(Action.DIAGNOSE, S.DIAGNOSING, basis | {
            "runbook": LIVE_RUNBOOK, "live": True,
            "reason": f"run runbook {LIVE_RUNBOOK} (not {rule.runbook}: the restart keeps the survivors running)"},
            f.now + rule.diagnosis_deadline)
    if rule.runbook:
        basis["diagnosis"] = "skipped: this healer does not run runbooks"
    return _remedy(f, rule, basis)


def _remedy(f: IncidentFacts, rule: Rule, basis: dict[str, Any]) -> Decision:
    remedy = rule.remedy
    if f.job is None and (remedy is None or remedy.restarts):
        # NOTE: the service alone has no launcher: a default remedy that would restart the job only notifies
        # (a rule that names such a remedy is refused when the service starts).
        remedy = Remedy.ESCALATE if remedy is Remedy.ESCALATE else Remedy.NOTIFY
        basis = basis | {"launcher": "none: notify only"}
    job_facts = f.job.facts if f.job is not None else JobFacts(nodes=())
    suspects = f.suspects
    if f.kind.swaps_slow and remedy is None:
        # NOTE: a slowdown restarts only by the swap its cost pays for: a slow link network-triage failed is borne
        # (notified) where bearing it costs less, not left out as a failed diagnosis would be.
        remedy = Remedy.NOTIFY
        if f.slowdown is not None and f.job is not None:
            call = swap_or_bear(f.slowdown, job_facts, f.limits)
            basis = basis | {"fail_slow": call}
            if call["swap"]:
                newest = max(job_facts.checkpoint_steps, default=None)
                if f.slowdown.step is not None and (newest is None or newest < f.slowdown.step):
                    return Decision(Action.WAIT, None, basis | {
                        "reason": f"the swap waits for a checkpoint after step {f.slowdown.step} (the newest is at "
                                  f"{'none' if newest is None else f'step {newest}'}): a swap there redoes no step"},
                        f.now + CHECKPOINT_RETRY)
                remedy, suspects = Remedy.EXCLUDE_AND_RESTART, (f.slowdown.host,)
    plan = restart_mode(choose(f.kind, remedy, suspects, f.first_bad_step, f.verdict, job_facts, f.limits, f.budget,
                               f.now, basis | ({"verdict": f.verdict.status.value} if f.verdict else {}),
                               f.stuck_hosts),
                        f.kind, job_facts, f.suspect_ranks if f.kind.replaces_named else ())
    if plan.not_before is not None:
        return Decision(Action.WAIT, None, plan.basis | {"reason": plan.basis.get("backoff", "backoff")},
                        plan.not_before, plan)
    if plan.remedy is Remedy.ESCALATE:
        return Decision(Action.ESCALATE, S.ESCALATED, plan.basis, plan=plan,
                        stop_job=f.job is not None and (f.kind.stops_job or f.kind.remedy.restarts))
    return Decision(Action.REMEDIATE, S.REMEDIATING, plan.basis, f.now + rule.recovery_deadline, plan)


def will_restart(kind: str, rule: Rule | None, state: IncidentState) -> bool:
    """Whether an open incident's decision, still to come, restarts the job: its remedy (the rule's, else its
    kind's) restarts it, or its kind stops the job (which comes back only by a restart). A healer that takes a run
    over starts the next attempt itself only when no incident will."""
    fk = fault(kind)
    remedy = rule.remedy if rule is not None and rule.remedy is not None else fk.remedy
    return state is not IncidentState.REMEDIATING and (remedy.restarts or fk.stops_job)


def page_now(policy: str, state: IncidentState) -> bool:
    """Whether the incident should carry page="true" to Alertmanager now."""
    if policy == "always":
        return state is not S.RESOLVED
    if policy == "never":
        return False
    return state is S.ESCALATED
