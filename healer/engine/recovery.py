"""The end of a restart, and a healer that takes a job over from one that died.

Recovery: an incident whose remediation restarted the job is resolved once an attempt started by it (or by a later
restart: one restart answers every fault before it) trains again; the step it resumed at is read from every step
the ranks recorded (never from a sampled heartbeat, which may have skipped the first step), and the work lost is
the steps the failed attempt had done past the checkpoint.

Take-over (`megaheal run --resume`): the incidents live in the store, so a healer started after one that died in
the middle of an incident finds them there and finishes each one: undecided ones are decided (diagnosed again if
the verdict died with the old healer), a restart that was ordered or started is carried out again (the launcher
stopped what the dead healer left running; this restart does not spend the restart budget twice).
"""

from __future__ import annotations

import logging
from datetime import datetime

from healer.decide.rules import Rule
from healer.decide.states import IncidentState
from healer.engine.respond import Responder
from healer.observe.jobview import TickView
from healer.ports import RestartOrder

log = logging.getLogger(__name__)
S = IncidentState


def recover(responder: Responder, view: TickView, now: datetime) -> list[int]:
    """Resolve the incidents whose restart trained again; returns their ids."""
    r = responder.remediator
    if r is None:
        return []
    state = r.state()
    if state.attempt is None or not state.running or not view.steps(r.job):
        return []
    # NOTE: a user's program keeps no record of its steps: the lowest step its ranks' heartbeats show now stands in
    # (the heartbeats carry each rank's newest step, so it may be a step or two past the first).
    first = r.first_step(state.attempt) if r.records_steps else min(view.steps(r.job))
    if first is None:
        return []  # the ranks' own record of the step is not written yet: next tick
    done = []
    for incident in responder.store.of_job(r.job, frozenset({S.REMEDIATING})):
        restarts = [row for row in responder.jobs.restarts(r.job) if row.incident_id == incident.id]
        started = [row for row in restarts if row.attempt is not None and row.attempt <= state.attempt]
        if not started:
            continue  # a notification, or a restart not started yet
        row = started[-1]
        trained_from = first
        if row.mode == "replica":
            # NOTE: a regroup keeps the attempt (its other groups never stopped): recovered once every host of it
            # trained since, the joining groups included
            since = row.started_at.timestamp() if row.started_at is not None else 0.0
            # (the hosts of it still in the job: one lost since is another incident's)
            joined = r.groups_trained(tuple(n for n in row.nodes if n in state.nodes), since)
            if joined is None:
                continue
            trained_from = joined
        lost = None if row.highest_step is None or row.from_step is None else \
            max(0, row.highest_step + 1 - row.from_step)
        evidence = {"reason": "recovered: the restarted job trains again", "attempt": state.attempt,
                    "first_step_after": trained_from, "resume_step": row.from_step, "highest_step": row.highest_step,
                    "lost_steps": lost}
        if not responder.store.transition(incident.id, S.REMEDIATING, S.RESOLVED, evidence, next_action_at=None):
            continue
        if row.outcome is None:
            responder.jobs.restart_ended(row.id, "recovered", now, trained_from)
        responder.metrics.transitions.labels(S.REMEDIATING.value, S.RESOLVED.value).inc()
        log.warning("incident %d recovered: attempt %d trains from step %d", incident.id, state.attempt, trained_from)
        responder.changed(incident.id, "transition", S.REMEDIATING.value, S.RESOLVED.value)
        done.append(incident.id)
    return done


def take_over(responder: Responder, now: datetime, adopted: int | None = None) -> list[int]:
    """Go on with the job's incidents that the dead healer left in flight; returns their ids. `adopted`: the attempt
    the launcher took over running (a restart that started it needs no second one: it recovers as it trains)."""
    r = responder.remediator
    assert r is not None, "only a healer with a launcher takes a job over"
    in_flight = responder.store.of_job(r.job, frozenset({S.OPEN, S.DIAGNOSING, S.REMEDIATING}))
    for incident in in_flight:
        responder.store.note(incident.id, {"reason": "a healer took the job over from one that died",
                                           "state": incident.state}, kind="taken-over")
        rule = responder.rules.get(incident.rule)
        if incident.state == S.OPEN.value:
            responder.store.set_next_action(incident.id, now)
        elif incident.state == S.DIAGNOSING.value:
            _diagnose_again(responder, incident.id, rule, now)
        else:
            _restart_again(responder, incident.id, adopted)
    return [i.id for i in in_flight]


def _diagnose_again(responder: Responder, incident_id: int, rule: Rule | None, now: datetime) -> None:
    if responder.store.latest_run(incident_id) is not None or rule is None or not rule.runbook:
        responder.store.set_next_action(incident_id, now)  # the verdict survived (or there is none to wait for)
        return
    incident = responder.store.row(incident_id)
    facts = responder.facts(incident, rule, now)
    # NOTE: after a take-over no warm pool runs (the new healer stops what it finds): the rule's runbook, job stopped.
    responder.diagnose(incident, rule.runbook, facts, stop_first=facts.kind.stops_job)


def _restart_again(responder: Responder, incident_id: int, adopted: int | None) -> None:
    r = responder.remediator
    assert r is not None
    rows = [row for row in responder.jobs.restarts(r.job) if row.incident_id == incident_id]
    if not rows or rows[-1].outcome == "recovered":
        return  # a notification waiting for its condition, or already recovered
    last = rows[-1]
    if adopted is not None and last.attempt == adopted:
        return  # its attempt outlived the healer and was adopted: it recovers once it trains
    # NOTE: a rollback resumes from its own checkpoint: the ones after it may hold the poisoned weights.
    resume_step = last.from_step if last.resume != "auto" else None
    restart_id = responder.jobs.add_restart(job=r.job, incident_id=incident_id, nodes=list(last.nodes),
                                            excluded=list(last.excluded), dp=last.dp, skip_steps=list(last.skip_steps),
                                            resume_step=resume_step, cause="take-over", highest_step=last.highest_step)
    order = RestartOrder(incident_id=incident_id, restart_id=restart_id, nodes=tuple(last.nodes),
                         dp=last.dp or r.state().dp, resume_step=resume_step, skip_steps=tuple(last.skip_steps or ()))
    r.restart(order, lambda result: responder.restarted(incident_id, None, restart_id, result))
