"""The remediation policy: a pure function from (incident, runbook verdict, budgets and job facts) to the action
the supervisor takes, with the basis of the choice recorded.

    crash, hang       verdict names bad nodes, or a suspect node is a lemon -> exclude them and restart
                      otherwise                                             -> restart in place
    gpu_fault         -> exclude the GPU's node and restart
    straggler         verdict (or a lemon) names the node -> exclude and restart; otherwise notify
    collective_slowdown  verdict names nodes -> exclude and restart; otherwise notify
    nonfinite, loss_spike  -> roll back to the newest good checkpoint before the first bad step and skip the
                      batches from that step back `skip_steps`
    anything else     -> notify

Excluding takes spare nodes first; with too few spares the job comes back smaller (its data-parallel degree
shrinks with the nodes, and the checkpoint is resharded), as long as `min_nodes` remain and the degree
divides evenly. Every action that restarts spends the restart budget: at most `max_restarts` in `window`,
each one after an exponential backoff; a spent budget escalates (pages) and the healer stops restarting.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

RESTART_KINDS = ("crash", "hang", "gpu_fault", "straggler", "collective_slowdown", "nonfinite", "loss_spike")


class Remedy(str, enum.Enum):
    RESTART = "restart-in-place"
    EXCLUDE_AND_RESTART = "exclude-node-and-restart"
    ROLLBACK = "rollback-and-skip"
    NOTIFY = "notify"
    ESCALATE = "escalate"
    WAIT = "wait"
    """Backoff: the action is due at `not_before`; decide again then."""


@dataclass(kw_only=True, slots=True)
class Budgets:
    """The policy's limits (a rule file's or the healer config's `remediation:` section)."""

    max_restarts: int = 5
    """Restarts allowed within `window`; one more escalates."""
    window: timedelta = timedelta(hours=1)
    """The sliding window the restart budget counts in."""
    backoff: timedelta = timedelta(seconds=0)
    """Wait before the second restart in the window; doubled for each further one (the first is immediate)."""
    max_backoff: timedelta = timedelta(minutes=5)
    """The backoff never grows past this."""
    lemon_incidents: int = 3
    """A node named in this many incidents (across jobs, within `lemon_window`) is excluded on sight."""
    lemon_window: timedelta = timedelta(days=7)
    """How far back node history counts."""
    min_nodes: int = 1
    """The job never runs on fewer nodes; below this it escalates."""
    skip_steps: int = 2
    """Steps' batches skipped at a loss spike or NaN: the first bad step and the ones just before it (a batch
    that poisons the weights shows in the *next* step's loss, so 1 would skip an innocent batch)."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window <= timedelta(0) or self.lemon_window <= timedelta(0):
            raise ValueError("window and lemon_window must be > 0")
        if self.backoff < timedelta(0) or self.max_backoff < self.backoff:
            raise ValueError(f"backoff must be >= 0 and <= max_backoff, got {self.backoff}, {self.max_backoff}")
        if self.lemon_incidents < 1 or self.min_nodes < 1 or self.skip_steps < 1:
            raise ValueError("lemon_incidents, min_nodes and skip_steps must be >= 1")


@dataclass(frozen=True, slots=True)
class IncidentInput:
    """The incident as the policy sees it."""

    id: int
    kind: str
    """The detector's name (crash, hang, ...), or the rule's kind."""
    suspect_nodes: tuple[str, ...] = ()
    """Nodes the detector named."""
    first_bad_step: int | None = None
    """For nonfinite / loss_spike: the first step with the bad value."""


@dataclass(frozen=True, slots=True)
class VerdictInput:
    status: str
    """pass | degraded | fail | error"""
    bad_nodes: tuple[str, ...] = ()
    """Nodes the runbook found faulty."""


@dataclass(frozen=True, slots=True)
class JobFacts:
    """What the supervisor and the node history know when the decision is made."""

    now: datetime
    nodes: tuple[str, ...]
    """Nodes the job runs on now."""
    spares: tuple[str, ...]
    """Healthy idle nodes that can replace an excluded one."""
    restarts: tuple[datetime, ...] = ()
    """When the job was restarted by the healer before (any order)."""
    node_incidents: dict[str, int] = field(default_factory=dict)
    """Per node, incidents naming it within the lemon window, across jobs (this one included)."""
    checkpoint_steps: tuple[int, ...] = ()
    """Steps of the good (verified) checkpoints on disk."""
    dp: int = 1
    """The job's data-parallel degree now."""


@dataclass(frozen=True, slots=True)
class Plan:
    remedy: Remedy
    basis: dict[str, Any]
    """Why: the facts and limits that made the choice."""
    exclude: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    """The node set to start on (for remedies that restart)."""
    dp: int | None = None
    """The data-parallel degree to start with."""
    resume_step: int | None = None
    """The checkpoint step to resume from; None: the newest good one."""
    skip_steps: tuple[int, ...] = ()
    """Steps whose batches are skipped after a rollback."""
    not_before: datetime | None = None
    """WAIT: when the action becomes due."""

    def to_payload(self) -> dict[str, Any]:
        return {"remedy": self.remedy.value, "decision_basis": self.basis, "exclude": list(self.exclude),
                "nodes": list(self.nodes), "dp": self.dp, "resume_step": self.resume_step,
                "skip_steps": list(self.skip_steps),
                "not_before": self.not_before.isoformat() if self.not_before else None}


def plan(incident: IncidentInput, verdict: VerdictInput | None, facts: JobFacts, budgets: Budgets) -> Plan:
    """Pure: the action for this incident. See the module docstring for the table."""
    basis: dict[str, Any] = {"incident": incident.id, "kind": incident.kind,
                             "verdict": verdict.status if verdict else None,
                             "verdict_bad_nodes": list(verdict.bad_nodes) if verdict else []}
    lemons = sorted(n for n in set(incident.suspect_nodes) | set(verdict.bad_nodes if verdict else ())
                    if facts.node_incidents.get(n, 0) >= budgets.lemon_incidents)
    if lemons:
        basis["lemons"] = {n: facts.node_incidents[n] for n in lemons}
    kind = incident.kind
    if kind not in RESTART_KINDS:
        return Plan(Remedy.NOTIFY, basis | {"reason": f"no automatic remediation for {kind}"})
    bad = tuple(sorted(set(verdict.bad_nodes if verdict and verdict.status in ("fail", "degraded") else ())
                       | set(lemons)))
    if kind == "gpu_fault":
        bad = tuple(sorted(set(bad) | set(incident.suspect_nodes)))
    if kind in ("nonfinite", "loss_spike"):
        return _gate(_rollback(incident, facts, budgets, basis), facts, budgets)
    if bad:
        return _gate(_exclude(bad, facts, budgets, basis), facts, budgets)
    if kind in ("crash", "hang"):
        return _gate(Plan(Remedy.RESTART, basis | {"reason": f"{kind} with no node found at fault: restart in place"},
                          nodes=facts.nodes, dp=facts.dp), facts, budgets)
    return Plan(Remedy.NOTIFY, basis | {"reason": f"{kind} without a node found at fault: notify only"})


def _exclude(bad: tuple[str, ...], facts: JobFacts, budgets: Budgets, basis: dict[str, Any]) -> Plan:
    leaving = tuple(n for n in facts.nodes if n in bad)
    if not leaving:
        return Plan(Remedy.RESTART, basis | {"reason": f"the bad node(s) {', '.join(bad)} are not in the job: "
                                             "restart in place"}, nodes=facts.nodes, dp=facts.dp)
    spares = [s for s in facts.spares if s not in bad]
    kept = [n for n in facts.nodes if n not in bad]
    if len(spares) >= len(leaving):
        new = tuple(kept + spares[:len(leaving)])
        return Plan(Remedy.EXCLUDE_AND_RESTART, basis | {
            "reason": f"exclude {', '.join(leaving)}; replace with spare(s) {', '.join(spares[:len(leaving)])}"},
            exclude=leaving, nodes=new, dp=facts.dp)
    new = tuple(kept + spares)
    n_old = len(facts.nodes)
    if len(new) < budgets.min_nodes or (facts.dp * len(new)) % n_old:
        return Plan(Remedy.ESCALATE, basis | {
            "reason": f"excluding {', '.join(leaving)} leaves {len(new)} node(s) and no spare: the job cannot "
                      f"run smaller (min_nodes {budgets.min_nodes}, dp {facts.dp} over {n_old} nodes)"},
            exclude=leaving)
    dp = facts.dp * len(new) // n_old
    return Plan(Remedy.EXCLUDE_AND_RESTART, basis | {
        "reason": f"exclude {', '.join(leaving)}; no spare left: restart on {len(new)} node(s) with dp {dp} "
                  f"(was {facts.dp}), resharding the checkpoint"}, exclude=leaving, nodes=new, dp=dp)


def _rollback(incident: IncidentInput, facts: JobFacts, budgets: Budgets, basis: dict[str, Any]) -> Plan:
    bad_step = incident.first_bad_step
    if bad_step is None:
        return Plan(Remedy.ESCALATE, basis | {"reason": f"{incident.kind} without the step it began at"})
    before = [s for s in facts.checkpoint_steps if s < bad_step]
    if not before:
        return Plan(Remedy.ESCALATE, basis | {"reason": f"no good checkpoint before step {bad_step}"})
    resume = max(before)
    # NOTE: a checkpoint of step N holds N steps done (0..N-1): the first step it can skip is N itself.
    first_skip = max(resume, bad_step - budgets.skip_steps + 1)
    skip = tuple(range(first_skip, bad_step + 1))
    return Plan(Remedy.ROLLBACK, basis | {
        "reason": f"{incident.kind} at step {bad_step}: roll back to the checkpoint of step {resume} and skip the "
                  f"batches of step(s) {', '.join(map(str, skip))}"},
        nodes=facts.nodes, dp=facts.dp, resume_step=resume, skip_steps=skip)


def _gate(p: Plan, facts: JobFacts, budgets: Budgets) -> Plan:
    """Apply the restart budget and the backoff to a plan that restarts."""
    if p.remedy not in (Remedy.RESTART, Remedy.EXCLUDE_AND_RESTART, Remedy.ROLLBACK):
        return p
    recent = sorted(t for t in facts.restarts if facts.now - t < budgets.window)
    budget = {"restarts_in_window": len(recent), "max_restarts": budgets.max_restarts,
              "window_s": budgets.window.total_seconds()}
    if len(recent) >= budgets.max_restarts:
        return Plan(Remedy.ESCALATE, p.basis | budget | {
            "reason": f"restart budget spent: {len(recent)} restarts in the last {budgets.window}; "
                      f"paging instead of restarting again (would have: {p.basis.get('reason')})"},
            exclude=p.exclude)
    if recent:
        backoff = min(budgets.backoff * (2 ** (len(recent) - 1)), budgets.max_backoff)
        due = recent[-1] + backoff
        budget["backoff_s"] = backoff.total_seconds()
        if facts.now < due:
            return Plan(Remedy.WAIT, p.basis | budget | {"reason": f"backoff: next restart due at {due.isoformat()}"},
                        exclude=p.exclude, nodes=p.nodes, dp=p.dp, not_before=due)
    return Plan(p.remedy, p.basis | budget, exclude=p.exclude, nodes=p.nodes, dp=p.dp, resume_step=p.resume_step,
                skip_steps=p.skip_steps)
