"""Responding to incidents: gather the facts, let the policy decide (healer.decide.policy, pure), claim the
transition in the store (a conditional UPDATE: of several healers on one database, one acts), then carry the
decision out through the remediator, off the loop: a diagnosis or a restart reports back through a callback that
writes the store and makes the incident due again.

What each incident goes through, as events in the store (healer.incidents.timeline reads them back):
detected (opened) -> [diagnosing -> diagnosed] -> decided (remediating: notified or restart ordered; escalated;
or resolved as superseded) -> restarted (the new attempt started) -> recovered (it trained: resolved).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from healer.decide.catalogue import UNNAMED_KINDS, Remedy, fault
from healer.decide.fail_slow import slowdown_from
from healer.decide.plans import JobFacts, ProgramFailure, Verdict, kept_out
from healer.decide.policy import Action, Decision, IncidentFacts, JobNow, decide, facts_of
from healer.decide.rules import DetectorCondition, Rule, RuleSet
from healer.decide.signals import Signal
from healer.decide.states import IncidentState
from healer.detect.hang_attribution import STUCK_IN_KERNEL, attribute
from healer.detect.suspects import Suspect, decode, on_hosts, ranks
from healer.detect.suspects import nodes as suspect_nodes
from healer.incidents.jobstore import JobStore
from healer.incidents.metrics import HealerMetrics
from healer.incidents.models import Incident
from healer.incidents.store import IncidentStore
from healer.ports import Diagnoser, Failed, HostVerdict, Remediator, RestartOrder, Started, to_verdict
from wire.verdict import Status

log = logging.getLogger(__name__)
S = IncidentState
RETRY_AFTER = timedelta(seconds=30)
FAULT_GRACE = timedelta(seconds=0.5)
"""SIGTERM to SIGKILL when the healer stops a job that cannot go on: its ranks are stuck in a collective that will
never complete, so no final checkpoint is possible and waiting longer only adds to the time to recover."""
Changed = Callable[[int, str, str | None, str | None], None]


def suspects_of(incident: Incident) -> tuple[str, ...]:
    """The hosts the incident blames: its suspects' (healer/detect/suspects.py) and the host it is on, if any."""
    named = suspect_nodes(decode(incident.suspects, f"incident {incident.id}"))
    return tuple(sorted({*named, *([incident.node] if incident.node else [])}))


def stuck_in_kernel(incident: Incident) -> tuple[str, ...]:
    """The hosts of a hang's named ranks when the look at the ranks found them held by the kernel (state D)."""
    evidence = incident.evidence if isinstance(incident.evidence, dict) else {}
    attribution = (evidence.get("stacks") or {}).get("attribution") or {}
    if not str(attribution.get("how", "")).startswith(STUCK_IN_KERNEL):
        return ()
    return tuple(suspect_nodes(decode(incident.suspects, f"incident {incident.id}")))


class Responder:
    def __init__(self, *, store: IncidentStore, jobs: JobStore, ruleset: RuleSet, metrics: HealerMetrics,
                 remediator: Remediator | None, diagnoser: Diagnoser | None, changed: Changed) -> None:
        self.store, self.jobs, self.ruleset, self.metrics = store, jobs, ruleset, metrics
        self.remediator, self.diagnoser, self.changed = remediator, diagnoser, changed
        self.rules = {r.name: r for r in ruleset.rules}
        self.halted: str | None = None
        """Why the healer stopped its job for good (an escalation of a fault the job cannot go on with)."""
        self.crash_loop: dict[str, Any] | None = None
        """The crash loop it stopped the job for (healer.decide.plans.crash_loop), if that was why."""

    # ---- new incidents -----------------------------------------------------------------------------------

    def opened(self, incident_id: int, signal: Signal) -> None:
        """A new (or reopened) incident: the job is known, and a lemon kind counts towards its hosts' history."""
        if signal.job:
            self.jobs.touch_job(signal.job)
        kind = fault(signal.kind)
        if kind.lemon and signal.job:
            hosts = {*suspect_nodes(signal.suspects), *([signal.node] if signal.node else [])}
            self.jobs.record_node_incidents(sorted(hosts), signal.job, str(incident_id), kind.name,
                                            incident_id=incident_id)

    # ---- due incidents -----------------------------------------------------------------------------------

    def respond_due(self, limit: int, now: datetime) -> bool:
        due = self.store.due(limit)
        for incident in due:
            try:
                self.respond(incident, now)
            except Exception:
                # NOTE: push the incident back before re-raising, so one bad incident cannot stall the others forever.
                # Logged here: the caller's log of the error cannot say which incident it was.
                log.error("incident %d: responding failed; tried again in %s", incident.id, RETRY_AFTER, exc_info=True)
                self.store.set_next_action(incident.id, now + RETRY_AFTER)
                raise
        return len(due) == limit

    def respond(self, incident: Incident, now: datetime) -> None:
        state = S(incident.state)
        rule = self.rules.get(incident.rule)
        if state is S.OPEN and fault(incident.kind).remedy is Remedy.ROLLBACK:
            incident = self._refine_first_bad_step(incident, rule)
        if state is S.OPEN and fault(incident.kind).looks_first and "stacks" not in (incident.evidence or {}):
            incident = self._look_at_hang(incident)
        facts = self.facts(incident, rule, now)
        decision = decide(facts)
        if decision.action is Action.WAIT or decision.to_state is None:
            self.store.set_next_action(incident.id, decision.next_action_at)
            return
        payload = decision.to_payload()
        if not self.store.transition(incident.id, state, decision.to_state, {"decision": payload},
                                     next_action_at=decision.next_action_at):
            self.metrics.claims_lost.inc()
            return
        self.metrics.transitions.labels(state.value, decision.to_state.value).inc()
        log.warning("incident %d: %s -> %s (%s)", incident.id, state.value, decision.to_state.value,
                    decision.basis.get("reason"))
        self.changed(incident.id, "transition", state.value, decision.to_state.value)
        if decision.action is Action.DIAGNOSE and rule is not None and rule.runbook:
            live = bool(decision.basis.get("live"))
            self.diagnose(incident, decision.basis["runbook"] if live else rule.runbook, facts,
                           stop_first=facts.kind.stops_job and not live)
        elif decision.action is Action.REMEDIATE:
            self._remediate(incident, decision, facts)
        elif decision.action is Action.ESCALATE:
            self._escalate(incident, decision)

    def facts(self, incident: Incident, rule: Rule | None, now: datetime) -> IncidentFacts:
        state = S(incident.state)
        return facts_of(incident_id=incident.id, kind=incident.kind, state=state, state_since=incident.state_since,
                        now=now, rule=rule, rules=self.ruleset, suspects=suspects_of(incident),
                        suspect_ranks=tuple(ranks(decode(incident.suspects, f"incident {incident.id}"))),
                        stuck_hosts=stuck_in_kernel(incident),
                        attempt=incident.attempt, first_bad_step=incident.first_bad_step,
                        verdict=self._verdict(incident.id) if state is S.DIAGNOSING else None,
                        job=self._job_now(incident, rule, now), diagnoser=self.diagnoser is not None,
                        failure=self._failure(incident) if state is S.OPEN else None,
                        # NOTE: also once diagnosed: a slow link's host is named by its runbook (network-triage)
                        slowdown=slowdown_from(incident.evidence or {}, incident.node)
                        if state in (S.OPEN, S.DIAGNOSING) and fault(incident.kind).swaps_slow else None)

    def _failure(self, incident: Incident) -> ProgramFailure | None:
        """The program's failure a crash incident names (its log's signature), with the step its attempt failed in
        and the step it started from where the ranks' records say."""
        sig = (incident.evidence or {}).get("signature") if incident.kind == "crash" else None
        if not isinstance(sig, str) or incident.attempt is None:
            return None
        nodes = tuple(n for n in (incident.evidence.get("signature_nodes") or ()) if isinstance(n, str))
        r = self.remediator
        step = started = None
        if r is not None and incident.job == r.job and r.records_steps:
            done = r.highest_step(incident.attempt)
            step = done + 1 if done is not None else None
            started = r.first_step(incident.attempt)
        return ProgramFailure(attempt=incident.attempt, signature=sig, nodes=nodes or ((incident.node,) if incident.node
                                                                                 else ()),
                       step=step, resumed_from=started)

    def _stalled_rollbacks(self, incident: Incident) -> int:
        """The job's rollbacks in a row that brought no net progress: since the last failed attempt that went past
        the highest step the job had reached, counting only if this incident's attempt did not go past it either."""
        r = self.remediator
        if r is None or not r.records_steps:
            return 0
        kinds = {other.id: other.kind for other in self.store.of_job(r.job)}
        high, stalled = -1, 0
        for restart in self.jobs.restarts(r.job):
            if restart.cause != "remediation":
                continue
            if restart.highest_step is not None and restart.highest_step > high:
                high, stalled = restart.highest_step, 0
            kind = kinds.get(restart.incident_id) if restart.incident_id is not None else None
            if kind is not None and fault(kind).remedy is Remedy.ROLLBACK:
                stalled += 1
        reached = r.highest_step(incident.attempt) if incident.attempt is not None else None
        return 0 if reached is not None and reached > high else stalled

    def _restart_cost_s(self, job: str) -> float | None:
        """The median seconds of the job's recovered restarts, from the decision to the new attempt's first step."""
        took = [(x.resumed_at - x.requested_at).total_seconds() for x in self.jobs.restarts(job)
                if x.outcome == "recovered" and x.resumed_at is not None]
        return statistics.median(took) if took else None

    def _failures(self, job: str, incident_id: int) -> tuple[ProgramFailure, ...]:
        """The program's failures in the job's other crash incidents."""
        return tuple(f for other in self.store.of_job(job) if other.id != incident_id and other.kind == "crash"
                     if (f := self._failure(other)) is not None)

    def _job_now(self, incident: Incident, rule: Rule | None, now: datetime) -> JobNow | None:
        r = self.remediator
        if r is None or incident.job != r.job:
            return None
        st = r.state()
        budget = self.ruleset.budget(rule)
        facts = JobFacts(nodes=st.nodes, spares=st.spares, dp=st.dp, valid_dp=st.valid_dp,
                         warm_unavailable=st.warm_unavailable, replica_hosts=st.replica_hosts,
                         checkpoint_steps=r.checkpoint_steps(), restarts=self.jobs.restart_times(r.job, now - budget.window),
                         unnamed_restarts=self.jobs.restart_times(r.job, now - budget.window, UNNAMED_KINDS)
                         if budget.per_hosts else (),
                         node_incidents=self.jobs.node_incident_counts(now - self.ruleset.limits.lemon_window),
                         # NOTE: read where the policy looks at them only (a crash as it opens, a rollback until
                         # its remedy is chosen): each reads the ranks' records.
                         failures=self._failures(r.job, incident.id) if incident.kind == "crash" and
                         incident.state == S.OPEN.value else (),
                         stalled_rollbacks=self._stalled_rollbacks(incident) if fault(incident.kind).remedy
                         is Remedy.ROLLBACK and incident.state in (S.OPEN.value, S.DIAGNOSING.value) else 0,
                         total_steps=st.total_steps, replica_groups=st.replica_groups,
                         restart_cost_s=self._restart_cost_s(r.job) if fault(incident.kind).swaps_slow else None)
        return JobNow(facts=facts, attempt=st.attempt, busy_with=self._busy_with(r.job, incident.id))

    def _busy_with(self, job: str, incident_id: int) -> int | None:
        """Another incident of the job whose diagnosis, or whose restart not yet started, is in flight."""
        for other in self.store.of_job(job, frozenset({S.DIAGNOSING, S.REMEDIATING})):
            if other.id == incident_id:
                continue
            if other.state == S.DIAGNOSING.value and fault(other.kind).stops_job:
                # NOTE: only a diagnosis with the job stopped holds the others up; one beside the training (a
                # network test across the hosts) must not keep a crash waiting for its restart.
                return other.id
            pending = self.jobs.pending_restart(other.id)
            if pending is not None and pending.attempt is None:
                return other.id
        return None

    def _verdict(self, incident_id: int) -> Verdict | None:
        run = self.store.latest_run(incident_id)
        if run is None or run.verdict is None:
            return None
        hosts = (run.result or {}).get("diagnosis") or []
        bad = tuple(h["node"] for h in hosts if isinstance(h, dict) and h.get("status") == Status.FAIL.value)
        try:
            status = Status(run.verdict)
        except ValueError:
            status = Status.ERROR  # a verdict this healer does not know names no host
        return Verdict(status=status, bad_nodes=bad)

    def _refine_first_bad_step(self, incident: Incident, rule: Rule | None) -> Incident:
        """The heartbeats sample steps; the ranks' own records have every step: take the true first bad one (the
        rollback skips the batches just before it, so one step late would skip the wrong ones)."""
        r = self.remediator
        if r is None or incident.job != r.job or incident.attempt is None:
            return incident
        params = rule.condition.params if rule is not None and isinstance(rule.condition, DetectorCondition) else None
        seen = incident.first_bad_step
        first = r.first_bad_step(incident.kind, incident.attempt, params, seen)
        if first is None or (seen is not None and first >= seen):
            return incident
        self.store.update_evidence(incident.id, {"first_step_from": "ranks/0.jsonl"}, first_bad_step=first)
        return self.store.row(incident.id)

    def _look_at_hang(self, incident: Incident) -> Incident:
        """Before anything is stopped: what every rank is doing (healer.detect.hang_attribution reads it), and the
        rank that holds the job up becomes the suspect. The detector alone names a stopped rank (state T) or the one
        behind; a rank spinning, blocked in a read or in another collective looks like all the others to it."""
        r = self.remediator
        if r is None or incident.job != r.job or incident.attempt is None:
            return incident
        t0 = time.monotonic()
        try:
            found = r.rank_evidence(incident.attempt)
        except Exception:
            log.warning("incident %d: the ranks could not be looked at", incident.id, exc_info=True)
            found = None
        if not found or not found.get("ranks"):
            self.store.update_evidence(incident.id, {"stacks": {"error": "no rank could be looked at",
                                                                "unreached": (found or {}).get("unreached", {})}})
            return self.store.row(incident.id)
        ev = incident.evidence if isinstance(incident.evidence, dict) else {}
        mesh = {x["rank"]: x["mesh"] for x in ev.get("ranks", [])
                if isinstance(x, dict) and isinstance(x.get("mesh"), dict)}
        att = attribute(found["ranks"], mesh)
        node_of = {x.get("rank"): x["node"] for x in found["ranks"]}
        named = tuple(Suspect(node=node_of.get(r), rank=r) for r in att.suspects)
        said = f"rank(s) {', '.join(map(str, att.suspects))} on {', '.join(suspect_nodes(named))}: {att.how}"
        update: dict[str, Any] = {
            "stacks": {"attempt": found.get("attempt"), "ranks": found["ranks"],
                       "unreached": found.get("unreached", {}), "attribution": att.to_payload(),
                       "took_s": round(time.monotonic() - t0, 3)},
            "suspected_by": att.how}
        log.warning("incident %d: the ranks' stacks name %s", incident.id, said)
        self.store.update_evidence(incident.id, update, summary=f"{incident.summary} [stacks: {said}]"[:2000],
                                   suspects=named or None)  # NOTE: none named: the detector's stand
        return self.store.row(incident.id)

    def restart_pending(self, incident_id: int) -> bool:
        return self.jobs.pending_restart(incident_id) is not None

    # ---- carrying decisions out --------------------------------------------------------------------------

    def diagnose(self, incident: Incident, runbook: str, facts: IncidentFacts, stop_first: bool) -> None:
        """`stop_first`: stop the job before the runbook runs (one that wants the hosts idle, for a fault that ended
        the job anyway)."""
        job = facts.job
        nodes = [n for n in facts.suspects if job is None or n in job.facts.nodes]
        # A runbook given as a file path is stored by its name (the column is short; the result holds the rest).
        name = runbook.rsplit("/", 1)[-1].removesuffix(".yaml").removesuffix(".yml")
        if self.remediator is not None and job is not None and facts.rule is not None \
                and facts.rule.runbook_scope == "job":
            nodes = list(job.facts.nodes)
            run_id = self.store.start_runbook_run(incident.id, name, nodes)
            self.remediator.diagnose_across(
                nodes, runbook, lambda verdicts: self._diagnosed(incident.id, run_id, name, verdicts, across=True))
            return
        run_id = self.store.start_runbook_run(incident.id, name, nodes)
        if self.remediator is not None and job is not None:
            self.remediator.diagnose(nodes, runbook, stop_first,
                                     lambda verdicts: self._diagnosed(incident.id, run_id, name, verdicts))
            return
        assert self.diagnoser is not None

        def done(verdict: str, summary: str, result: dict[str, Any] | None) -> None:
            # NOTE: the note first: the tick decides as soon as the run has its verdict, and the timeline must read
            # diagnosed before decided.
            self.store.note(incident.id, {"runbook": name, "verdict": verdict, "summary": summary}, kind="diagnosed")
            self.store.finish_runbook_run(run_id, incident.id, verdict, summary, result)
            log.info("incident %d: runbook %s: %s", incident.id, runbook, summary)

        self.diagnoser.submit(runbook, nodes, done)

    def _diagnosed(self, incident_id: int, run_id: int, runbook: str, verdicts: list[HostVerdict],
                   across: bool = False) -> None:
        verdict = to_verdict(verdicts)
        summary = "; ".join(f"{v.node}: {v.status.value}: {v.summary}" for v in verdicts) or "no host to diagnose"
        hosts = [v.to_payload() for v in verdicts]
        for v in verdicts:
            if v.status is not Status.PASS:
                log.warning("incident %d: %s on %s: %s: %s", incident_id, runbook, v.node, v.status.value, v.summary)
        self.store.note(incident_id, {"runbook": runbook, "verdict": verdict.status.value, "diagnosis": hosts},
                        kind="diagnosed")
        if across:
            # NOTE: before the verdict is there to decide on: the host it names is what a swap weighs (fail-slow).
            self._name_hosts(incident_id, runbook, [v for v in verdicts if v.status is Status.FAIL])
        # NOTE: after the note: the tick decides as soon as the run has its verdict (diagnosed before decided).
        self.store.finish_runbook_run(run_id, incident_id, verdict.status.value, summary[:4000], {"diagnosis": hosts})

    def _name_hosts(self, incident_id: int, runbook: str, failed: list[HostVerdict]) -> None:
        """Hosts a runbook across the job's hosts failed go into the incident's evidence and summary (which host,
        which link, measured against expected), and become its suspects when the detector named none (a collective
        slowdown). A runbook per suspect host names no new host: its verdicts are in the diagnosis already."""
        if not failed:
            return
        incident = self.store.row(incident_id)
        named = {v.node: {"summary": v.summary, **v.details} for v in failed}
        said = "; ".join(f"{runbook}: {v.node}: {v.summary}" for v in failed)
        self.store.update_evidence(incident_id, {"named_by": {"runbook": runbook, "hosts": named}},
                                   summary=f"{incident.summary} [{said}]"[:2000],
                                   suspects=None if suspects_of(incident) else on_hosts(named))

    def _remediate(self, incident: Incident, decision: Decision, facts: IncidentFacts) -> None:
        plan = decision.plan
        assert plan is not None
        payload = plan.to_payload()
        if not plan.remedy.restarts:
            self.store.add_remediation(incident.id, plan.remedy.value, payload, "notified")
            return
        r = self.remediator
        assert r is not None and incident.job == r.job, "the policy restarts only a job with a launcher"
        if plan.exclude:
            self.jobs.exclude_nodes(plan.exclude, r.job, incident.id,
                                    f"incident {incident.id} ({incident.kind}): {plan.basis.get('reason')}")
        earlier = {s for row in self.jobs.restarts(r.job) for s in (row.skip_steps or [])}
        skip = tuple(sorted(earlier | set(plan.skip_steps)))
        highest = r.highest_step(incident.attempt) if incident.attempt is not None else None
        remediation_id = self.store.add_remediation(incident.id, plan.remedy.value, payload, "ordered", finished=False)
        restart_id = self.jobs.add_restart(job=r.job, incident_id=incident.id, nodes=list(plan.nodes),
                                           excluded=list(plan.exclude), dp=plan.dp, skip_steps=list(skip),
                                           resume_step=plan.resume_step, highest_step=highest)
        order = RestartOrder(incident_id=incident.id, restart_id=restart_id, nodes=plan.nodes,
                             dp=plan.dp or (facts.job.facts.dp if facts.job else 1), resume_step=plan.resume_step,
                             skip_steps=skip, warm=plan.warm, released=plan.released,
                             replace_ranks=plan.replace_ranks, keep_out=kept_out(incident.kind, plan),
                             replica=plan.replica,
                             mode_why=str((plan.basis.get("restart") or {}).get("why", "")))
        r.restart(order, lambda result: self.restarted(incident.id, remediation_id, restart_id, result,
                                                        incident.attempt))

    def restarted(self, incident_id: int, remediation_id: int | None, restart_id: int,
                   result: Started | Failed, stopped: int | None = None) -> None:
        if isinstance(result, Started):
            # NOTE: read again now that the attempt is stopped: its ranks trained on between the decision and the
            # stop, and those steps are lost too (the goodput ledger counts them from the same records).
            highest = self.remediator.highest_step(stopped) if self.remediator and stopped is not None else None
            self.jobs.restart_started(restart_id, result.attempt, result.at, result.from_step, result.resume,
                                      highest_step=highest, mode=result.mode, mode_why=result.mode_why)
            if remediation_id is not None:
                self.store.finish_remediation(remediation_id, "started")
            self.store.note(incident_id, {"attempt": result.attempt, "resume_step": result.from_step,
                                          "resume": result.resume, "nodes": list(result.nodes), "dp": result.dp,
                                          "mode": result.mode, "mode_why": result.mode_why,
                                          "stages": result.stages},
                            kind="restarted")
            return
        self.jobs.restart_ended(restart_id, "failed")
        if remediation_id is not None:
            self.store.finish_remediation(remediation_id, "failed")
        self.store.note(incident_id, {"reason": result.reason, "permanent": result.permanent}, kind="restart-failed")
        log.error("incident %d: the restart could not be started: %s", incident_id, result.reason)
        if self.store.transition(incident_id, S.REMEDIATING, S.ESCALATED,
                                 {"reason": f"the restart could not be started: {result.reason}"}, next_action_at=None):
            self._halt(f"incident {incident_id}: the restart could not be started")
            self.changed(incident_id, "transition", S.REMEDIATING.value, S.ESCALATED.value)

    def _escalate(self, incident: Incident, decision: Decision) -> None:
        self.store.add_remediation(incident.id, Remedy.ESCALATE.value, decision.to_payload(), "paged")
        if decision.stop_job and self.remediator is not None and incident.job == self.remediator.job:
            if "crash_loop" in decision.basis:
                self.crash_loop = decision.basis["crash_loop"]
                self._fold_into_loop(incident, self.crash_loop["signature"])
            self._halt(f"incident {incident.id} escalated: {decision.basis.get('reason')}")

    def _fold_into_loop(self, loop: Incident, signature: str) -> None:
        """The earlier incidents of the same failure whose restart only led into the loop: closed here, pointing at
        the loop's incident, which is the one that pages (their restarts never trained, so nothing else would ever
        close them once the job is stopped)."""
        for other in self.store.of_job(loop.job or "", frozenset({S.REMEDIATING})):
            if other.id != loop.id and (other.evidence or {}).get("signature") == signature:
                reason = f"its restart ran into the crash loop of incident {loop.id}, which stopped the job"
                if self.store.transition(other.id, S.REMEDIATING, S.RESOLVED, {"reason": reason}):
                    self.changed(other.id, "transition", S.REMEDIATING.value, S.RESOLVED.value)

    def _halt(self, reason: str) -> None:
        self.halted = reason
        if self.remediator is not None:
            self.remediator.stop(reason, FAULT_GRACE)
