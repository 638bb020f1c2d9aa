"""What an incident page says in words before any table: the headline (what happened, to which job, host and rank,
what megaheal did, whether the job was stopped and whether a person was paged) and the decision in sentences with
its numbers (the policy's decision_basis, healer/decide/policy.py and plans.py). Pure functions over the store's
incident (IncidentStore.get: with its events), its timeline (healer/incidents/timeline.py) and its restarts.

NOTE: a basis key these builders do not know is not dropped: `decision_sentences` hands it back for a small table,
so a key the policy learns later still shows, as its name and value.
"""

from __future__ import annotations

import re
from typing import Any

from healer.decide.catalogue import fault
from healer.pages.axes import duration

HAPPENED = {"crash": "crashed", "hang": "hung", "gpu_fault": "had a GPU fault", "straggler": "held the job up",
            "host_lost": "was lost", "heartbeat_stale": "stopped reporting", "nonfinite": "hit a NaN or Inf",
            "loss_spike": "had a loss spike", "collective_slowdown": "slowed down in its collectives",
            "job_slowdown": "trained slower as a whole", "sdc": "computed wrong results (silent data corruption)",
            "rerun": "had a suspect step re-run",
            "healer_blind": "went silent to the healer", "node_down": "went down",
            "telemetry_absent": "lost its telemetry"}
"""Per catalogue kind, the verb of the headline."""
BASIS_DONE = frozenset({"reason", "rule", "remediate", "remedy_from", "runbook", "kind", "verdict", "verdict_bad_nodes",
                        "lemons", "lemon_incidents", "lemon_window_s", "restart", "restarts_in_window",
                        "unnamed_restarts_in_window", "max_restarts", "budget_scale", "window_s", "backoff_s",
                        "backoff", "deadline_s", "live", "diagnosis", "launcher", "fail_slow", "tainted_checkpoints",
                        "exposure"})
"""The basis keys said in sentences; any other is shown as it is."""


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1] if items else ""


def who(ranks: list[int], nodes: list[str]) -> str:
    """'rank 3 on n2', 'ranks 1 and 3 on n2', 'n2': the suspects as a subject."""
    if ranks:
        said = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_join([str(r) for r in ranks[:8]])}" + (
            f" (and {len(ranks) - 8} more)" if len(ranks) > 8 else "")
        return said + (f" on {_join(nodes)}" if nodes else "")
    return _join(nodes)


def lost_steps(value: int | None) -> str:
    """A restart's lost steps in words: never 'None step(s)'."""
    if value is None:
        return "steps lost: unknown"
    return "no steps lost" if value == 0 else f"{value} step{'s' if value != 1 else ''} lost"


def status_said(text: str | None) -> str:
    """A runbook summary with a status said once: 'n1: pass: pass: 3 step(s) passed' -> 'n1: pass: 3 step(s)
    passed' (the run's summary prefixes each host's status, and a host's summary may start with it again)."""
    return re.sub(r"\b(pass|degraded|fail|error|skipped): \1: ", r"\1: ", text or "")


def _stopped(incident: dict[str, Any]) -> bool:
    """Whether a decision of the incident stopped the job (an escalation of a fault that stopped it)."""
    for e in incident.get("events") or []:
        decision = (e.get("evidence") or {}).get("decision") if isinstance(e.get("evidence"), dict) else None
        if isinstance(decision, dict) and decision.get("stop_job"):
            return True
    return False


def paged(incident: dict[str, Any], stages: list[str]) -> tuple[bool, str]:
    """(whether on-call was paged, why in words), from the rule's page policy and whether the incident escalated
    (healer.decide.policy.page_now: the page label Alertmanager routes on)."""
    policy = incident.get("page")
    escalated = "escalated" in stages or incident.get("state") == "escalated"
    if policy == "always":
        return True, "on-call was paged (its rule pages always)"
    if policy == "never":
        return False, "nobody was paged (its rule never pages)"
    if escalated:
        return True, "on-call was paged: it escalated"
    return False, "nobody was paged: it did not escalate"


def _subject(incident: dict[str, Any], ranks: list[int], nodes: list[str]) -> str:
    job = incident.get("job")
    names_host = fault(incident["kind"]).names_host
    whom = who(ranks, nodes) if names_host else ""
    verb = HAPPENED.get(incident["kind"], f"had a {incident['kind']} incident")
    if whom:
        # NOTE: "Rank 3 ...", but a host's name as it is spelled ("n2 went down", never "N2").
        said = f"R{whom[1:]}" if whom.startswith("rank") else whom
        return f"{said} {verb}" + (f" in job {job}" if job else "")
    return f"Job {job} {verb}" if job else f"{incident['kind']}: {incident.get('summary') or ''}".strip()


def _action(t: dict[str, Any] | None, restarts: list[dict[str, Any]], stopped: bool,
            remediations: list[dict[str, Any]], job: bool) -> str:
    """What megaheal did, in words."""
    if t is None and remediations:  # no job, no timeline: what the service did (notify, escalate)
        t = {"action": remediations[-1].get("action"), "stages": [], "plan": None}
    if t is None or t.get("action") is None:
        state = t.get("state") if t else None
        if t is not None and "diagnosed" in t.get("stages", []) or state == "diagnosing":
            return "megaheal is diagnosing it and has decided nothing yet"
        return "megaheal has not acted on it yet"
    plan = t.get("plan") or {}
    basis = plan.get("decision_basis") or {}
    action = t["action"]
    if action == "resolve":
        return "megaheal did nothing: a restart for another incident had already replaced the attempt it happened in"
    if action == "notify":
        return "megaheal notified on-call" + (" and left the job running" if job else "")
    if action == "escalate":
        return "megaheal stopped the job and escalated to a person" if stopped else "megaheal escalated to a person"
    out: list[str] = []
    lemons = basis.get("lemons") or {}
    left = list(plan.get("exclude") or [])
    for node in left:
        if node in lemons:
            out.append(f"left {node} out as a lemon")
        elif node in (basis.get("verdict_bad_nodes") or []):
            out.append(f"left {node} out (it failed its diagnosis)")
        else:
            out.append(f"left {node} out")
    started = [r for r in restarts if r.get("started_at") is not None]
    step = t.get("resume_step") if t.get("resume_step") is not None else plan.get("resume_step")
    mode = t.get("restart_mode") or ("warm" if plan.get("warm") else None)
    if mode == "cold":
        out.insert(0, "stopped the job")
    how = {"warm": "restarted it warm (the surviving ranks kept running)",
           "cold": "restarted it cold"}.get(mode or "", "restarted it")
    if action == "rollback-and-skip":
        skip = plan.get("skip_steps") or []
        how = f"rolled it back to the checkpoint of step {step}" + (
            f" and skipped step{'s' if len(skip) != 1 else ''} {_join([str(s) for s in skip])}" if skip else "")
        how += f" ({mode} restart)" if mode else ""
    elif step is not None:
        how += f" from step {step}"
    if plan.get("nodes") and left:
        how += f" on {_join(list(plan['nodes']))}"
    if not started and t.get("remediated_at") is None:
        failed = any(r.get("outcome") == "failed" for r in restarts)
        out = [o for o in out if o != "stopped the job"]
        how = ("ordered a restart that could not be started" if failed else "ordered a restart, not started yet")
    return "megaheal " + _join(out + [how])


def headline(incident: dict[str, Any], t: dict[str, Any] | None, restarts: list[dict[str, Any]],
             ranks: list[int], nodes: list[str], remediations: list[dict[str, Any]] | None = None) -> str:
    """One paragraph, in words: what happened, to whom; what megaheal did; whether the job was stopped; whether a
    person was paged; where it stands now."""
    stages = list(t.get("stages") or []) if t else []
    stopped = _stopped(incident)
    said = f"{_subject(incident, ranks, nodes)}" + (f" (attempt {t['attempt']})" if t and t.get("attempt") is not None
                                                   else "")
    action = _action(t, restarts, stopped, remediations or [], bool(incident.get("job")))
    kind = fault(incident["kind"])
    if t is not None and t.get("action") in ("notify", None) and kind.stops_job and incident.get("job"):
        action += "; the job cannot go on without a restart"
    _, page = paged(incident, stages)
    out = f"{said}: {action}; {page}."
    if t is not None and t.get("recovered_at") is not None:
        out += (f" It trained again at step {t.get('first_step_after')}, {duration(t['recovered_at'] - t['detected_at'])}"
                f" after detection ({lost_steps(t.get('lost_steps'))}).")
    elif incident.get("state") == "resolved":
        out += " It is resolved."
    elif incident.get("state") == "acknowledged":
        out += f" {incident.get('acknowledged_by') or 'A person'} has acknowledged it."
    else:
        out += f" It is {incident.get('state')}."
    return out


# ---- the decision in sentences -----------------------------------------------------------------------------------

def _window(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "its window"
    s = float(seconds)
    for unit, length in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= length and s % length == 0:
            n = int(s // length)
            return f"the last {unit}" if n == 1 else f"the last {n} {unit}s"
    return f"the last {duration(s)}"


def decision_sentences(plan: dict[str, Any] | None, basis: dict[str, Any] | None = None
                       ) -> tuple[list[str], list[tuple[str, Any]]]:
    """(sentences, the basis keys no sentence says, with their values). `plan`: the plan's payload (its
    decision_basis the basis); `basis`: a decision's basis where there is no plan (a wait, an escalation)."""
    plan = plan or {}
    b = dict(basis if basis is not None else plan.get("decision_basis") or {})
    out: list[str] = []
    if b.get("reason"):
        out.append(f"Why: {b['reason']}.")
    if b.get("rule"):
        source = {"catalogue": f"the fault catalogue's default for a {b.get('kind') or 'fault of this kind'}",
                  "rule": "the rule's own remediate:",
                  "a host proven bad": "changed to leaving hosts out: a host was proven bad"}.get(
            str(b.get("remedy_from")), None)
        out.append(f"Rule {b['rule']} matched; its remedy is {b.get('remediate') or '-'}"
                   + (f" ({source})" if source else "") + ".")
    if b.get("runbook"):
        bad = list(b.get("verdict_bad_nodes") or [])
        if b.get("verdict"):
            out.append(f"Diagnosis: runbook {b['runbook']} said {b['verdict']}"
                       + (f"; it failed {_join(bad)}" if bad else "; it failed no host") + ".")
        elif b.get("diagnosis"):
            out.append(f"Diagnosis {b['diagnosis']}.")
        else:
            out.append(f"Runbook {b['runbook']} was not run before this decision.")
    if b.get("live"):
        out.append("Only the live checks ran: they leave the surviving processes running for a warm restart.")
    limit = b.get("lemon_incidents")
    for node, count in sorted((b.get("lemons") or {}).items()):
        within = _window(b.get("lemon_window_s")) if b.get("lemon_window_s") is not None else "the lemon window"
        out.append(f"{node} was left out as a lemon: it was named in {count} incidents within {within}"
                   + (f" (lemon threshold {limit})" if limit is not None else "") + ".")
    restart = b.get("restart")
    if isinstance(restart, dict) and restart.get("mode"):
        out.append(f"The restart is {restart['mode']}" + (f": {restart['why']}" if restart.get("why") else "") + ".")
    if b.get("max_restarts") is not None:
        n = b.get("restarts_in_window")
        scale = b.get("budget_scale")
        scaled = (f" ({scale['restarts']} for each {scale['per_hosts']:,} hosts; the job has {scale['hosts']:,})"
                  if isinstance(scale, dict) and all(isinstance(scale.get(k), int)
                                                     for k in ("restarts", "per_hosts", "hosts")) else "")
        out.append(f"Restart budget: {n} restart{'s' if n != 1 else ''} in {_window(b.get('window_s'))} before this "
                   f"one, of at most {b['max_restarts']}{scaled}.")
    if b.get("backoff_s"):
        out.append(f"Backoff: {duration(float(b['backoff_s']))} after the previous restart"
                   + (f" ({b['backoff']})" if b.get("backoff") else "") + ".")
    elif b.get("backoff"):
        out.append(f"Backoff: {b['backoff']}.")
    if b.get("deadline_s") is not None:
        out.append(f"The deadline it missed: {duration(float(b['deadline_s']))}.")
    if b.get("launcher"):
        out.append("This healer has no launcher for the job: it can notify, not restart.")
    slow = b.get("fail_slow")
    if isinstance(slow, dict) and slow.get("reason"):
        sources = f" (steps left from {slow['steps_left_from']}; the swap's cost {slow['swap_cost_from']})" \
            if slow.get("steps_left_from") and slow.get("swap_cost_from") else ""
        out.append(f"Swap or bear: {slow['reason']}{sources}.")
    tainted = b.get("tainted_checkpoints")
    if isinstance(tainted, list) and tainted:
        out.append(f"Tainted: the checkpoints of steps {', '.join(map(str, tainted))} were saved after the host's first "
                   "suspect step" + (f"; {b['exposure']}" if b.get("exposure") else "") + ".")
    out += _plan_sentences(plan)
    rest = [(k, v) for k, v in b.items() if k not in BASIS_DONE]
    return out, rest


def _plan_sentences(plan: dict[str, Any]) -> list[str]:
    out = []
    if plan.get("exclude"):
        out.append(f"Left out: {_join(list(plan['exclude']))}.")
    if plan.get("nodes") and plan.get("remedy") not in ("notify", "escalate"):
        out.append(f"The job runs on {_join(list(plan['nodes']))}" + (f" with dp {plan['dp']}" if plan.get("dp")
                                                                       else "") + ".")
    if plan.get("released"):
        out.append(f"{_join(list(plan['released']))} left idle as spare(s).")
    if plan.get("resume_step") is not None:
        out.append(f"It resumes from the checkpoint of step {plan['resume_step']}.")
    if plan.get("skip_steps"):
        out.append(f"The batches of step(s) {_join([str(s) for s in plan['skip_steps']])} are skipped.")
    if plan.get("not_before"):
        out.append(f"Not before {plan['not_before']}.")
    return out


def decision_of(incident: dict[str, Any], t: dict[str, Any] | None) -> tuple[dict[str, Any] | None,
                                                                             dict[str, Any] | None]:
    """(the plan, the basis) of the incident's decision: the timeline's plan where there is one, else the newest
    decision its events hold (an escalation for a deadline has a basis and no plan)."""
    if t is not None and t.get("plan"):
        return t["plan"], None
    for e in reversed(incident.get("events") or []):
        decision = (e.get("evidence") or {}).get("decision") if isinstance(e.get("evidence"), dict) else None
        if isinstance(decision, dict) and isinstance(decision.get("basis"), dict):
            return decision.get("plan"), decision["basis"]
    return None, None
