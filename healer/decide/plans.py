"""Choosing the remedy of an incident: a pure function from the incident, its runbook verdict, the job's facts and
the limits to a Plan, with the basis of the choice recorded.

The remedy is the rule's `remediate:` or, when the rule leaves it unset, the fault catalogue's default; a host
that a diagnosis failed, or a lemon, is left out whenever the remedy restarts (and, with the default remedy, even
when the kind would only notify: a host proven bad is not kept in a job the healer can act on).

    restart                    hosts proven bad (failed diagnosis, lemon) left out; otherwise restart in place
    exclude-node-and-restart   the suspects too (a GPU fault's host is at fault by definition)
    rollback-and-skip          restart from the newest good checkpoint before the first bad step, skipping the
                               batches from that step back `skip_steps`
    notify, escalate           as they say

Leaving hosts out takes spares first; with too few, the job comes back smaller: its data-parallel degree shrinks
with the hosts, if the training layout accepts the new degree and `min_nodes` remain. A data-parallel replica may
span several hosts (pipeline stages, or tensor groups wider than a host): the job then shrinks by whole replicas,
and the healthy hosts a partial replica would leave are released, idle, as spares. Every restart spends the
restart budget (at most `max_restarts` in `window`, each after an exponential backoff); a spent budget escalates.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from healer.decide.catalogue import FaultKind, Remedy, fault
from wire.verdict import Status


@dataclass(kw_only=True, slots=True)
class RestartBudget:
    """How often a job may be restarted (a rule's `budget:`, or the rule set's `remediation.budget`)."""

    max_restarts: int = 5
    """Restarts allowed within `window`; one more escalates."""
    window: timedelta = timedelta(hours=1)
    """The sliding window the budget counts in (every restart of the job counts, whatever its rule)."""
    backoff: timedelta = timedelta(seconds=0)
    """Wait before the second restart in the window; doubled for each further one (the first is immediate)."""
    max_backoff: timedelta = timedelta(minutes=5)
    """The backoff never grows past this."""
    per_hosts: int = 0
    """`max_restarts` for each this many of the job's hosts (the count rounded up; never fewer than `max_restarts`);
    0: for the whole job, whatever its size. Hosts fail independently: a job of 12,288 hosts meets six times the
    faults of one of 2,048, each healed by one restart, and a fixed budget pages on-call for a busy hour of a healthy
    job (the simulator's 65,536 and 98,304 GPUs: 28 and 77 pages in 54 days, each a budget spent by healed faults).
    The loops the budget is for are caught at the same count in a job of any size: a program's crash loop by
    `crash_loop` at its repeat, a NaN loop by the unscaled count of faults that name no host (`gate`)."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.per_hosts < 0:
            raise ValueError(f"per_hosts must be >= 0, got {self.per_hosts}")
        if self.window <= timedelta(0):
            raise ValueError(f"window must be > 0, got {self.window}")
        if self.backoff < timedelta(0) or self.max_backoff < self.backoff:
            raise ValueError(f"backoff must be >= 0 and <= max_backoff, got {self.backoff}, {self.max_backoff}")

    def allowed(self, hosts: int) -> int:
        """The restarts allowed within `window` for a job on `hosts` hosts."""
        if not self.per_hosts:
            return self.max_restarts
        return self.max_restarts * max(1, -(-hosts // self.per_hosts))


@dataclass(kw_only=True, slots=True)
class Limits:
    """The policy's limits for a job (a rule file's `remediation:` section)."""

    budget: RestartBudget = field(default_factory=RestartBudget)
    """The restart budget of rules that set none of their own."""
    lemon_incidents: int = 3
    """A host named in this many incidents (across jobs, within `lemon_window`) is left out on sight."""
    lemon_window: timedelta = timedelta(days=7)
    """How far back host history counts."""
    min_nodes: int = 1
    """The job never runs on fewer hosts; below this it escalates."""
    skip_steps: int = 2
    """Steps' batches skipped at a loss spike or NaN: the first bad step and the ones just before it (a batch that
    poisons the weights shows in the *next* step's loss, so 1 would skip an innocent batch)."""
    swap_cost: timedelta = timedelta(minutes=2)
    """What replacing a slow host with a spare is taken to cost until the job has a recovered restart of its own to
    measure (healer/decide/fail_slow.py); a straggler that would cost more before the job ends is swapped."""
    slow_horizon: timedelta | None = None
    """How far ahead a straggler's cost is projected where the job's length is not known (a program's); None: not at
    all, and such a job's stragglers are only notified (megaheal cannot tell how long a program will still run)."""

    def __post_init__(self) -> None:
        if self.lemon_window <= timedelta(0):
            raise ValueError(f"lemon_window must be > 0, got {self.lemon_window}")
        if self.swap_cost <= timedelta(0) or (self.slow_horizon is not None and self.slow_horizon <= timedelta(0)):
            raise ValueError(f"swap_cost and slow_horizon must be > 0, got {self.swap_cost}, {self.slow_horizon}")
        if self.lemon_incidents < 1 or self.min_nodes < 1 or self.skip_steps < 1:
            raise ValueError("lemon_incidents, min_nodes and skip_steps must be >= 1")


@dataclass(frozen=True, slots=True)
class Verdict:
    """A finished diagnosis as the policy sees it."""

    status: Status
    """pass, degraded, fail or error (error: the runbook could not run; it names no host)."""
    bad_nodes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Status(self.status))  # a status's name is taken too; a typo is an error


@dataclass(frozen=True, slots=True)
class ProgramFailure:
    """A crash of the job's program as the crash detector saw it (healer/detect/logtail.py: signature)."""

    attempt: int
    signature: str
    """The exception's type and its innermost frame ("ValueError at model.py:212 in forward")."""
    nodes: tuple[str, ...]
    """The hosts whose ranks failed with it in that attempt."""
    step: int | None = None
    """The step the attempt failed in (the one after the last it finished); None: not known."""
    resumed_from: int | None = None
    """The step the attempt started from (its checkpoint); None: not known."""

    @property
    def key(self) -> tuple[str, int | None, int | None]:
        """What two failures must share to be the same: the exception, where, at which step, from which start."""
        return self.signature, self.step, self.resumed_from


@dataclass(frozen=True, slots=True)
class JobFacts:
    """What the launcher and the store know of the job when the decision is made."""

    nodes: tuple[str, ...]
    """Hosts the job runs on now, in node-rank order."""
    spares: tuple[str, ...] = ()
    """Healthy idle hosts that can replace one left out."""
    dp: int = 1
    """The job's data-parallel degree now."""
    valid_dp: tuple[int, ...] = ()
    """Data-parallel degrees the training layout accepts for this job (train/layout.py); empty: any."""
    checkpoint_steps: tuple[int, ...] = ()
    """Steps of the good (verified) checkpoints."""
    restarts: tuple[datetime, ...] = ()
    """When the job was restarted by a remediation (take-overs do not count)."""
    unnamed_restarts: tuple[datetime, ...] = ()
    """Those of `restarts` for a fault that names no host (a NaN, a loss spike): a budget scaled by hosts
    (RestartBudget.per_hosts) holds them to its unscaled `max_restarts`."""
    node_incidents: dict[str, int] = field(default_factory=dict)
    """Per host, incidents naming it within the lemon window, across jobs (this one included)."""
    warm_unavailable: str | None = "the job does not run warm"
    """Why no restart of the job can be warm now; None: one can (its attempts run as warm generations)."""
    replica_hosts: dict[str, str] = field(default_factory=dict)
    """Per host of the job, the host whose ranks keep the replicas of its ranks' snapshots (train/warm/replicas.py);
    empty: none elsewhere (a job on one host), so a host that leaves takes its ranks' state with it."""
    failures: tuple[ProgramFailure, ...] = ()
    """The program's crashes in the job's earlier attempts (what crash_loop compares)."""
    stalled_rollbacks: int = 0
    """Rollbacks in a row before this one that brought no net progress: none of their failed attempts went past the
    highest step the job had reached (nor did the attempt this incident ended)."""
    total_steps: int | None = None
    """The steps the job trains in all, where its launcher knows them (megaheal's trainer); None: a program's."""
    restart_cost_s: float | None = None
    """The median seconds of this job's recovered restarts, from the decision to the new attempt's first step; None:
    none yet."""
    replica_groups: int = 0
    """The job trains as replica groups, one per host, joined by a per-step quorum (train/ft/): at most this many
    take part in a step. 0: the job is one world, and every restart stops all of it."""


@dataclass(frozen=True, slots=True)
class Plan:
    remedy: Remedy
    basis: dict[str, Any]
    """Why: the facts and limits that made the choice."""
    exclude: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    """The host set to start on (remedies that restart)."""
    dp: int | None = None
    resume_step: int | None = None
    """The checkpoint step to resume from; None: the newest good one."""
    skip_steps: tuple[int, ...] = ()
    not_before: datetime | None = None
    """Backoff: the restart is due then; decide again at that time (`remedy` is what it would be)."""
    warm: bool = False
    """Restart warm: the surviving ranks keep their processes and state (basis["restart"] says why either way)."""
    released: tuple[str, ...] = ()
    """Healthy hosts of the job the smaller restart leaves idle (a partial replica): spares from now on."""
    replace_ranks: tuple[int, ...] = ()
    """Ranks whose live processes a warm restart replaces with standbys (a hang's: they hold the job up)."""
    replica: bool = False
    """Replace only the replica groups of the hosts at fault (a spare's group joins by a live peer's state) while
    every other group trains on: nothing else of the job is stopped (basis["restart"] says why)."""

    def to_payload(self) -> dict[str, Any]:
        return {"remedy": self.remedy.value, "decision_basis": self.basis, "exclude": list(self.exclude),
                "nodes": list(self.nodes), "released": list(self.released), "dp": self.dp,
                "resume_step": self.resume_step,
                "skip_steps": list(self.skip_steps), "warm": self.warm, "replace_ranks": list(self.replace_ranks),
                "replica": self.replica,
                "not_before": self.not_before.isoformat() if self.not_before else None}


def choose(kind: FaultKind, remedy: Remedy | None, suspects: tuple[str, ...], first_bad_step: int | None,
           verdict: Verdict | None, job: JobFacts, limits: Limits, budget: RestartBudget, now: datetime,
           basis: dict[str, Any], stuck: tuple[str, ...] = ()) -> Plan:
    """The plan for an incident of `kind` (`remedy` None: the catalogue's default, see the module docstring).
    `stuck`: hosts whose rank the kernel holds (state D, a hang's look at the ranks): proven bad as a failed
    diagnosis is, for nothing of the job can run there until the host is repaired."""
    basis = basis | {"kind": kind.name, "verdict": verdict.status.value if verdict else None,
                     "verdict_bad_nodes": list(verdict.bad_nodes) if verdict else []}
    if stuck:
        basis["stuck_in_kernel"] = list(stuck)
    lemons = sorted(n for n in set(suspects) | set(verdict.bad_nodes if verdict else ())
                    if job.node_incidents.get(n, 0) >= limits.lemon_incidents)
    if lemons:
        basis["lemons"] = {n: job.node_incidents[n] for n in lemons}
        basis["lemon_incidents"] = limits.lemon_incidents
        basis["lemon_window_s"] = limits.lemon_window.total_seconds()
    proven = set(verdict.bad_nodes if verdict and verdict.status in (Status.FAIL, Status.DEGRADED) else ()) | \
        set(lemons) | set(stuck)
    chosen = remedy
    if chosen is None:
        chosen = Remedy.EXCLUDE_AND_RESTART if proven & set(job.nodes) else kind.remedy
        basis["remedy_from"] = "catalogue" if chosen is kind.remedy else "a host proven bad"
    else:
        basis["remedy_from"] = "rule"
    if chosen is Remedy.ESCALATE:
        return Plan(Remedy.ESCALATE, basis | {"reason": "the rule escalates to a person"})
    if chosen is Remedy.NOTIFY:
        return Plan(Remedy.NOTIFY, basis | {"reason": f"{kind.name}: notify, then wait for the condition to clear"})
    if chosen is Remedy.ROLLBACK:
        if job.stalled_rollbacks >= STALLED_ROLLBACKS:
            return Plan(Remedy.ESCALATE, basis | {
                "stalled_rollbacks": job.stalled_rollbacks,
                "reason": f"{kind.name}: this would be rollback {job.stalled_rollbacks + 1} in a row without net "
                          "progress (no attempt since went past the job's highest step): rolling back again would "
                          "loop; paging"})
        return gate(_rollback(kind, first_bad_step, job, limits, basis), job, budget, now, kind.names_host)
    # NOTE: a kind that names no host (a NaN, a spike: every rank sees it after the reduce) leaves out the hosts
    # proven bad alone, never its suspects: a lemon among them once made a NaN leave out every host of the job.
    targets = proven | (set(suspects) if chosen is Remedy.EXCLUDE_AND_RESTART and kind.names_host else set())
    if targets & set(job.nodes):
        plan = _exclude(tuple(sorted(targets)), job, limits, basis)
        if kind.taints and first_bad_step is not None and plan.remedy is Remedy.EXCLUDE_AND_RESTART:
            plan = untainted(plan, first_bad_step, job, tuple(n for n in job.nodes if n in targets))
        return gate(plan, job, budget, now, kind.names_host)
    why = "no host found at fault" if chosen is Remedy.RESTART else "the hosts to leave out are not in the job"
    return gate(Plan(Remedy.RESTART, basis | {"reason": f"{kind.name} with {why}: restart in place"},
                     nodes=job.nodes, dp=job.dp), job, budget, now, kind.names_host)


def crash_loop(failure: ProgramFailure | None, job: JobFacts) -> dict[str, Any] | None:
    """The basis of a crash loop, or None: the same failure of the program (ProgramFailure.key) in an earlier
    attempt, and the two together on two hosts or more. The fault is then the application's: restarting, on any host,
    fails the same way again. A signal, a lost host or a peer's echo has no signature, and never loops."""
    if failure is None:
        return None
    same = [f for f in job.failures if f.attempt != failure.attempt and f.key == failure.key]
    hosts = sorted({*failure.nodes, *(n for f in same for n in f.nodes)})
    if not same or len(hosts) < 2:
        return None
    attempts = sorted({failure.attempt, *(f.attempt for f in same)})
    where = f" at step {failure.step}" if failure.step is not None else ""
    start = f", resumed from step {failure.resumed_from}" if failure.resumed_from is not None else ""
    return {"signature": failure.signature, "step": failure.step, "resumed_from": failure.resumed_from,
            "attempts": attempts, "hosts": hosts,
            "reason": f"crash loop: {failure.signature}{where}{start}, in attempts {', '.join(map(str, attempts))} "
                      f"on {', '.join(hosts)}: the program's own failure, which no restart on any host mends; "
                      f"stopped (exit {CRASH_LOOP_EXIT}: do not requeue)"}


STALLED_ROLLBACKS = 2
"""Rollbacks in a row without net progress after which the next one escalates instead (the third)."""
CRASH_LOOP_EXIT = 78
"""`megaheal run`'s exit status when it stopped a crash loop: the program fails the same way wherever it runs, so a
scheduler must not run it again as it is (deploy/slurm/megaheal.sbatch passes it on; 78 is sysexits' EX_CONFIG)."""


def kept_out(kind: str, plan: Plan) -> tuple[str, ...]:
    """The hosts `plan` leaves out that no screening takes back: lemons, and every one a kind that keeps its hosts out
    leaves (FaultKind.keeps_out). The others come back once they pass their screening again (a repaired host)."""
    lemons = set(plan.basis.get("lemons") or {})
    return tuple(sorted(n for n in plan.exclude if fault(kind).keeps_out or n in lemons))


def untainted(plan: Plan, first_bad_step: int, job: JobFacts, leaving: tuple[str, ...]) -> Plan:
    """`plan`, resuming from the newest checkpoint saved before `leaving` could have spoiled the state: their first
    suspect step is `first_bad_step`, and a checkpoint of more steps holds updates they took part in (the checks
    keep out what they caught, not what they did not). Named even when none newer is saved yet: the stop that ends
    the attempt saves one (SIGTERM), which would be resumed otherwise. Without one that old, it resumes from the
    newest and says what is exposed."""
    tainted = sorted(s for s in job.checkpoint_steps if s > first_bad_step)
    clean = [s for s in job.checkpoint_steps if s <= first_bad_step]
    hosts = ", ".join(leaving)
    said = ", ".join(map(str, tainted))
    if not clean:
        if not tainted:
            return plan
        return replace(plan, basis=plan.basis | {
            "tainted_checkpoints": tainted, "exposure": f"every checkpoint (steps {said}) was saved after {hosts}'s "
                                                        f"first suspect step {first_bad_step}: none is known clean, "
                                                        "the newest is resumed"})
    resume = max(clean)
    why = (f"the checkpoints of steps {said}, saved since {hosts}'s first suspect step {first_bad_step}, are "
           f"tainted" if tainted else f"none saved since {hosts}'s first suspect step {first_bad_step} (the stop's "
                                      "own save would be) may be resumed")
    return replace(plan, resume_step=resume, basis=plan.basis | {
        "tainted_checkpoints": tainted,
        "reason": f"{plan.basis['reason']}; {why}: resume from the checkpoint of step {resume}"})


def _exclude(bad: tuple[str, ...], job: JobFacts, limits: Limits, basis: dict[str, Any]) -> Plan:
    leaving = tuple(n for n in job.nodes if n in bad)
    spares = [s for s in job.spares if s not in bad]
    kept = [n for n in job.nodes if n not in bad]
    if len(spares) >= len(leaving):
        # NOTE: each spare takes the place (the node rank) of the host it replaces: its ranks are the lost host's
        # ranks, so a warm restart hands them that host's state from their replicas.
        instead = dict(zip(leaving, spares))
        return Plan(Remedy.EXCLUDE_AND_RESTART, basis | {
            "reason": f"exclude {', '.join(leaving)}; replace with spare(s) {', '.join(spares[:len(leaving)])}"},
            exclude=leaving, nodes=tuple(instead.get(n, n) for n in job.nodes), dp=job.dp)
    new = tuple(kept + spares)
    n_old = len(job.nodes)
    released: tuple[str, ...] = ()
    per_replica = n_old // job.dp if job.dp >= 1 and n_old % job.dp == 0 else None
    if per_replica and len(new) % per_replica:
        # NOTE: a replica spans `per_replica` hosts: the smaller job keeps whole replicas only, and what is left of
        # the last one waits as spares (healthy: they are not drained), taken again at the next host's loss.
        usable = len(new) // per_replica * per_replica
        new, released = new[:usable], new[usable:]
    cannot = None
    if len(new) < limits.min_nodes:
        cannot = f"it would leave {len(new)} host(s), below min_nodes {limits.min_nodes}"
    elif (job.dp * len(new)) % n_old:
        cannot = f"dp {job.dp} over {n_old} hosts does not shrink evenly to {len(new)}"
    elif job.valid_dp and job.dp * len(new) // n_old not in job.valid_dp:
        cannot = (f"the training layout does not accept dp {job.dp * len(new) // n_old} "
                  f"(it accepts {', '.join(map(str, job.valid_dp))})")
    if cannot:
        return Plan(Remedy.ESCALATE, basis | {
            "reason": f"excluding {', '.join(leaving)} with no spare left: the job cannot run smaller ({cannot})"},
            exclude=leaving)
    dp = job.dp * len(new) // n_old
    idle = f"; {', '.join(released)} left idle as spare(s) ({per_replica} hosts a replica)" if released else ""
    return Plan(Remedy.EXCLUDE_AND_RESTART, basis | {
        "reason": f"exclude {', '.join(leaving)}; no spare left: restart on {len(new)} host(s) with dp {dp} "
                  f"(was {job.dp}), resharding the checkpoint{idle}"},
        exclude=leaving, nodes=new, dp=dp, released=released)


def _rollback(kind: FaultKind, bad_step: int | None, job: JobFacts, limits: Limits, basis: dict[str, Any]) -> Plan:
    if bad_step is None:
        return Plan(Remedy.ESCALATE, basis | {"reason": f"{kind.name} without the step it began at"})
    before = [s for s in job.checkpoint_steps if s < bad_step]
    if not before:
        return Plan(Remedy.ESCALATE, basis | {"reason": f"no good checkpoint before step {bad_step}"})
    resume = max(before)
    # NOTE: a checkpoint of step N holds N steps done (0..N-1): the first step it can skip is N itself.
    skip = tuple(range(max(resume, bad_step - limits.skip_steps + 1), bad_step + 1))
    return Plan(Remedy.ROLLBACK, basis | {
        "reason": f"{kind.name} at step {bad_step}: roll back to the checkpoint of step {resume} and skip the "
                  f"batches of step(s) {', '.join(map(str, skip))}"},
        nodes=job.nodes, dp=job.dp, resume_step=resume, skip_steps=skip)


def warm_reason(kind: FaultKind, job: JobFacts) -> str | None:
    """Why an incident of `kind` may restart the job warm; None when it cannot (see restart_mode)."""
    return kind.warm if kind.warm and job.warm_unavailable is None else None


def replica_reason(kind: FaultKind, job: JobFacts) -> str | None:
    """Why an incident of `kind` may be answered by replacing the replica groups of its hosts alone, the others
    training on; None when it cannot: the job is one world, or the fault is not a host's (a bad batch spoils every
    group's state alike: they all roll back together)."""
    if not job.replica_groups or not kind.names_host or kind.bad_step is not None:
        return None
    return (f"{kind.name}: the job trains as replica groups, one per host: the other groups go on with each step "
            "without the one at fault, and a group started in its place joins by a live peer's state")


def restart_mode(p: Plan, kind: FaultKind, job: JobFacts, replace_ranks: tuple[int, ...] = ()) -> Plan:
    """`p` with its restart made warm where that is safe, and why it is warm or cold in its basis: warm only for a
    kind whose surviving processes are trusted, in a job whose attempts run warm and whose current attempt is not
    itself a warm restart that never trained, and when every lost rank's state survives somewhere: a host that
    leaves is replaced in its place (the same layout) and the host that keeps its ranks' replicas stays.
    `replace_ranks`: the ranks a kind that replaces named ones (a hang: the ranks holding the job up) replaces."""
    if not p.remedy.restarts:
        return p
    replica = replica_reason(kind, job) if p.remedy is not Remedy.ROLLBACK else None
    if replica is not None:
        # NOTE: sets: a job of 12,288 hosts made these O(n^2), 0.75 s a decision in the simulation
        after, before = set(p.nodes), set(job.nodes)
        leaving = [n for n in job.nodes if n not in after]
        joining = [n for n in p.nodes if n not in before]
        if joining:
            said = (f"replace the replica group(s) of {', '.join(leaving)} with the spare's on {', '.join(joining)}, "
                    "which joins from a live peer; the other groups train on")
        elif leaving:
            said = (f"leave the replica group(s) of {', '.join(leaving)} out (no spare): the {len(p.nodes)} others "
                    "train on")
        else:
            said = "start the replica group(s) that failed again in place, from a live peer; the others train on"
        return replace(p, replica=True, basis=p.basis | {"reason": f"{kind.name}: {said}", "restart": {
            "mode": "replica", "why": replica, "leaving": leaving, "joining": joining,
            "groups": f"{len(job.nodes)} -> {len(p.nodes)}"}})
    why = warm_reason(kind, job)
    if why is None:
        cold = job.warm_unavailable if kind.warm else f"{kind.name}: the ranks' processes cannot be trusted after it"
        return _cold(p, cold)
    if kind.replaces_named and not replace_ranks:
        return _cold(p, f"{kind.name}: no rank is named as the one at fault, so none can be replaced alone")
    if (p.dp is not None and p.dp != job.dp) or len(p.nodes) != len(job.nodes):
        return _cold(p, f"the layout changes ({len(job.nodes)} -> {len(p.nodes)} hosts, dp {job.dp} -> {p.dp}): "
                        "the snapshots fit the old one; the checkpoint reshards")
    after, before = set(p.nodes), set(job.nodes)
    lost = [n for n in job.nodes if n not in after]
    if lost:
        gone = [n for n in lost if job.replica_hosts.get(n) in (None, *lost)]
        if gone:
            held = ", ".join(f"{n}'s on {job.replica_hosts[n]}" if n in job.replica_hosts else f"{n}'s nowhere else"
                             for n in gone)
            return _cold(p, f"the state of the ranks of {', '.join(gone)} is lost with the replicas ({held})")
        why += "; " + "; ".join(f"{new} takes the place of {old}, its ranks' state from their replicas on "
                                f"{job.replica_hosts[old]}" for old, new in zip(job.nodes, p.nodes) if old != new)
    elif [n for n in p.nodes if n not in before]:
        return _cold(p, "the hosts change")
    basis = p.basis | {"restart": {"mode": "warm", "why": why}}
    if replace_ranks:
        basis["restart"]["replace_ranks"] = list(replace_ranks)
    return replace(p, warm=True, replace_ranks=tuple(replace_ranks), basis=basis)


def _cold(p: Plan, why: str) -> Plan:
    return replace(p, basis=p.basis | {"restart": {"mode": "cold", "why": why}})


def gate(p: Plan, job: JobFacts, budget: RestartBudget, now: datetime, names_host: bool = True) -> Plan:
    """Apply the restart budget and the backoff to a plan that restarts; `names_host`: whether its fault's kind
    names a host (one that names none is held to the unscaled budget, see below)."""
    if not p.remedy.restarts:
        return p
    recent = sorted(t for t in job.restarts if now - t < budget.window)
    allowed = budget.allowed(len(job.nodes))
    spent: dict[str, Any] = {"restarts_in_window": len(recent), "max_restarts": allowed,
                             "window_s": budget.window.total_seconds()}
    if budget.per_hosts:
        spent["budget_scale"] = {"restarts": budget.max_restarts, "per_hosts": budget.per_hosts,
                                 "hosts": len(job.nodes)}
    # NOTE: the scale is for faults of hosts, which come the more often the more hosts a job has. A fault that names
    # no host (a NaN: bad data, a diverging run, or a corrupting GPU nothing judged) does not; its restarts in a
    # row are a loop a person should see at the same count in a job of any size. Scaled alone, the simulation's
    # replica groups (no re-run judges a corrupting host there) rolled back from a broken host for hours unpaged.
    unnamed = [t for t in job.unnamed_restarts if now - t < budget.window]
    if budget.per_hosts and not names_host and len(unnamed) >= budget.max_restarts:
        return Plan(Remedy.ESCALATE, p.basis | spent | {
            "unnamed_restarts_in_window": len(unnamed),
            "reason": f"restart budget spent: {len(unnamed)} restarts in the last {budget.window} for faults that "
                      f"named no host, of at most {budget.max_restarts} whatever the job's size; paging instead of "
                      f"restarting again (would have: {p.basis.get('reason')})"}, exclude=p.exclude)
    if len(recent) >= allowed:
        return Plan(Remedy.ESCALATE, p.basis | spent | {
            "reason": f"restart budget spent: {len(recent)} restarts in the last {budget.window}; "
                      f"paging instead of restarting again (would have: {p.basis.get('reason')})"},
            exclude=p.exclude)
    if recent:
        backoff = min(budget.backoff * (2 ** (len(recent) - 1)), budget.max_backoff)
        spent["backoff_s"] = backoff.total_seconds()
        due = recent[-1] + backoff
        if now < due:
            return replace(p, basis=p.basis | spent | {"backoff": f"next restart due at {due.isoformat()}"},
                           not_before=due)
    return replace(p, basis=p.basis | spent)
