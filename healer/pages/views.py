"""What each page shows, read from the healer's database and, where the job's run directory is known, from the
files the run left there. Nothing here writes, and nothing here renders.

Where the run directory is known (the single-file report; the service with `run_roots`), the goodput ledger is
computed from it (healer.ledger.goodput, exactly as `megaheal report` does) and the heat map and the loss plot are
drawn from the ranks' step records. Without it the ledger is the one `megaheal run` wrote into the database
(goodput_intervals), and the pages say what they cannot show.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from healer.decide.states import IncidentState
from healer.incidents.jobstore import JobStore
from healer.incidents.models import Incident, Remediation
from healer.incidents.store import IncidentStore
from healer.incidents.timeline import job_timelines, suspects
from healer.ledger.goodput import CATEGORIES, KINDS, Interval, compute, intervals
from healer.pages import heatmap, lossplot, waterfall
from healer.pages.cost import Cost, incident_costs
from healer.pages.hosts import host_table
from healer.pages.rundir import RunDir, find_run_dir

STATES = tuple(s.value for s in IncidentState)
PAGE_SIZE = 100


@dataclass(frozen=True, slots=True)
class Sources:
    """Where the pages read from."""

    engine: Engine
    run_roots: tuple[Path, ...] = ()
    """Directories holding run directories named after their jobs (the service's `run_roots`)."""
    run_dir: Path | None = None
    """One run directory, whatever its job's name (the single-file report)."""
    grafana_url: str | None = None

    def run_for(self, job: str | None) -> RunDir | None:
        if job is None:
            return None
        if self.run_dir is not None:
            run = RunDir(self.run_dir)
            return run if run.exists() and run.job() == job else None
        return find_run_dir(list(self.run_roots), job)


@dataclass(frozen=True, slots=True)
class Filters:
    job: str = ""
    state: str = ""
    kind: str = ""
    node: str = ""


@dataclass(slots=True)
class JobLedger:
    job: str
    source: str | None
    """"run directory", "database", or None (no ledger recorded)."""
    run: RunDir | None
    timelines: list[dict[str, Any]]
    """healer.incidents.timeline payloads, with the ledger's stage lengths (detected_in_s, ...) where computed."""
    spans: list[Interval] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    ettr: float | None = None
    steps_done: int | None = None
    lost_steps: int | None = None
    costs: dict[int, Cost] = field(default_factory=dict)


def job_ledger(src: Sources, job: str) -> JobLedger:
    timelines = [t.to_payload() for t in job_timelines(src.engine, job)]
    run = src.run_for(job)
    out = JobLedger(job=job, source=None, run=run, timelines=timelines)
    if run is not None and run.attempts():
        ledger = compute(run.path, timelines)
        out.source, out.timelines, out.spans = "run directory", ledger.incidents, intervals(run.path, timelines)
        out.seconds, out.wall_s, out.ettr = ledger.seconds, ledger.wall_s, ledger.ettr
        out.steps_done, out.lost_steps = ledger.steps_done, ledger.lost_steps
    else:
        rows = JobStore(src.engine).intervals(job)
        out.spans = [Interval(r.kind, r.started_at.timestamp(), r.ended_at.timestamp(), r.incident_id, r.steps)
                     for r in rows]
        if out.spans:
            out.source = "database"
            out.seconds = dict.fromkeys(CATEGORIES, 0.0)
            for s in out.spans:
                out.seconds[CATEGORIES[KINDS.index(s.kind)] if s.kind in KINDS else "other"] += s.seconds
            out.wall_s = out.spans[-1].end - out.spans[0].start
            out.ettr = out.seconds["productive"] / out.wall_s if out.wall_s > 0 else None
    restarts = [(r.incident_id, r.started_at.timestamp()) for r in JobStore(src.engine).restarts(job)
                if r.incident_id is not None and r.started_at is not None]
    # No ledger, no cost: a page says "-" rather than a zero it does not know.
    out.costs = incident_costs(out.spans, restarts, {t["id"]: _ranks(run, t) for t in out.timelines}) \
        if out.spans else {}
    return out


def _ranks(run: RunDir | None, t: dict[str, Any]) -> int | None:
    """The ranks of the attempt the incident happened in; from its evidence when there is no run directory."""
    attempt = run.attempt(t.get("attempt")) if run is not None else None
    if attempt is not None and attempt.ranks:
        return attempt.ranks
    ev = t.get("evidence") or {}
    if isinstance(ev.get("ranks_in_table"), int) and ev["ranks_in_table"] > 0:
        return int(ev["ranks_in_table"])  # the phase table of a large job is only its most unusual rows
    listed = ev.get("ranks") or ev.get("phase_table")
    return len(listed) if isinstance(listed, list) and listed else None


# ---- the incidents page ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Row:
    id: int
    kind: str
    state: str
    severity: str
    job: str | None
    node: str | None
    summary: str
    opened_at: datetime
    ranks: list[int]
    nodes: list[str]
    cost: Cost | None


@dataclass(frozen=True, slots=True)
class IncidentList:
    rows: list[Row]
    filters: Filters
    offset: int
    more: bool
    choices: dict[str, list[str]]
    """Known values of each filter (for the form)."""


def incident_list(src: Sources, filters: Filters, offset: int = 0, limit: int = PAGE_SIZE,
                  ledgers: dict[str, JobLedger] | None = None) -> IncidentList:
    """Newest first; `ledgers`: jobs' ledgers the caller has already (each incident's cost comes from its job's)."""
    query = select(Incident).order_by(Incident.id.desc())
    for column, value in ((Incident.job, filters.job), (Incident.state, filters.state),
                          (Incident.kind, filters.kind), (Incident.node, filters.node)):
        if value:
            query = query.where(column == value)
    with Session(src.engine) as session:
        found = list(session.execute(query.limit(limit + 1).offset(offset)).scalars())
        choices = {name: sorted(str(v) for v in session.execute(select(column).distinct().limit(500)).scalars() if v)
                   for name, column in (("job", Incident.job), ("kind", Incident.kind), ("node", Incident.node))}
    choices["state"] = list(STATES)
    ledgers = dict(ledgers or {})
    for job in {i.job for i in found[:limit] if i.job} - ledgers.keys():
        ledgers[job] = job_ledger(src, job)
    rows = []
    for i in found[:limit]:
        ranks, nodes = suspects(i.id, i.suspects, i.node)
        cost = ledgers[i.job].costs.get(i.id) if i.job else None
        rows.append(Row(i.id, i.kind, i.state, i.severity, i.job, i.node, i.summary, i.opened_at, ranks, nodes, cost))
    return IncidentList(rows, filters, offset, len(found) > limit, choices)


# ---- one incident ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class IncidentView:
    incident: dict[str, Any]
    """The store's incident with its events and runbook runs (IncidentStore.get)."""
    timeline: dict[str, Any] | None
    remediations: list[dict[str, Any]]
    restarts: list[dict[str, Any]]
    cost: Cost | None
    heat: heatmap.HeatMap | None
    heat_note: str
    ranks: list[int]
    nodes: list[str]
    grafana: str | None
    has_run: bool


def incident_view(src: Sources, incident_id: int, ledger: JobLedger | None = None) -> IncidentView:
    """Raises healer.errors.NotFound. `ledger`: the job's, when the caller has it already (the report)."""
    incident = IncidentStore(src.engine, "pages").get(incident_id)
    job = incident["job"]
    ledger = ledger or (job_ledger(src, job) if job else None)
    timeline = next((t for t in ledger.timelines if t["id"] == incident_id), None) if ledger else None
    ranks, nodes = suspects(incident_id, incident["suspects"], incident["node"])
    heat, note = _heat(ledger.run if ledger else None, timeline, ranks)
    with Session(src.engine) as session:
        remediations = [{"action": r.action, "decided_at": r.decided_at, "finished_at": r.finished_at,
                         "outcome": r.outcome, "basis": r.basis} for r in session.execute(
            select(Remediation).where(Remediation.incident_id == incident_id).order_by(Remediation.id)).scalars()]
    restarts = [{"attempt": r.attempt, "requested_at": r.requested_at, "started_at": r.started_at,
                 "resumed_at": r.resumed_at, "from_step": r.from_step, "resumed_step": r.resumed_step,
                 "nodes": r.nodes, "excluded": r.excluded, "dp": r.dp, "outcome": r.outcome, "cause": r.cause}
                for r in JobStore(src.engine).restarts(job) if r.incident_id == incident_id] if job else []
    return IncidentView(incident, timeline, remediations, restarts, ledger.costs.get(incident_id) if ledger else None,
                        heat, note, ranks, nodes, _grafana(src.grafana_url, incident), ledger is not None
                        and ledger.run is not None)


def _heat(run: RunDir | None, timeline: dict[str, Any] | None,
          ranks: list[int]) -> tuple[heatmap.HeatMap | None, str]:
    if timeline is None:
        return None, "this incident names no job: there are no per-rank step records to draw"
    if run is None:
        return None, ("the job's run directory is not known to this healer (set run_roots in its config): the "
                      "per-rank step records are there")
    attempt = run.attempt(timeline.get("attempt")) or run.attempt_at(timeline["detected_at"])
    heat = heatmap.build(run, attempt, timeline["detected_at"], ranks, evidence_nodes(timeline["evidence"])) \
        if attempt is not None else None
    return heat, "" if heat is not None else "no step records from the attempt this incident happened in"


def evidence_nodes(evidence: dict[str, Any]) -> dict[int, str]:
    """rank -> host from the detectors' per-rank lists (hang: ranks, straggler: phase_table, crash: failed)."""
    out = {}
    for key in ("ranks", "phase_table", "failed"):
        for item in evidence.get(key) or []:
            if isinstance(item, dict) and isinstance(item.get("rank"), int) and isinstance(item.get("node"), str):
                out[item["rank"]] = item["node"]
    return out


def _grafana(base: str | None, incident: dict[str, Any]) -> str | None:
    """The training dashboard of the incident's job, from ten minutes before it opened."""
    if not base or not incident["job"]:
        return None
    from urllib.parse import urlencode

    opened = datetime.fromisoformat(incident["opened_at"])
    start = int(opened.timestamp() * 1000) - 600_000
    end = (int(datetime.fromisoformat(incident["resolved_at"]).timestamp() * 1000) + 300_000
           if incident["resolved_at"] else "now")
    query = urlencode({"var-job": incident["job"], "from": start, "to": end})
    return f"{base.rstrip('/')}/d/megaheal-training/megaheal-training?{query}"


# ---- one job ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class JobView:
    job: str
    ledger: JobLedger
    goodput: waterfall.Waterfall | None
    strip: waterfall.Strip | None
    plot: lossplot.LossPlot | None
    attempts: list[Any]
    """rundir.Attempt where the run directory is known, else the database's restarts (dicts)."""
    incidents: IncidentList
    hosts: list[dict[str, Any]] = field(default_factory=list)
    """healer.pages.hosts rows where the run directory is known."""


def job_view(src: Sources, job: str, ledger: JobLedger | None = None) -> JobView:
    ledger = ledger or job_ledger(src, job)
    marks = [(t["id"], t["kind"], t["detected_at"]) for t in ledger.timelines]
    fall = waterfall.waterfall(ledger.seconds, ledger.wall_s) if ledger.seconds else None
    run = ledger.run
    attempts: list[Any] = run.attempts() if run is not None else [
        {"attempt": r.attempt, "started_at": r.started_at, "nodes": r.nodes, "excluded": r.excluded, "dp": r.dp,
         "resume": r.resume, "outcome": r.outcome, "incident": r.incident_id} for r in JobStore(src.engine).restarts(job)]
    return JobView(job, ledger, fall, waterfall.strip(ledger.spans, marks),
                   lossplot.build(run, marks) if run is not None else None, attempts,
                   incident_list(src, Filters(job=job), limit=1000, ledgers={job: ledger}),
                   host_table(run.path, ledger.timelines) if run is not None else [])


def stage_list(t: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(stage, seconds after detection, what) of the stages the incident went through, in order."""
    detected = t["detected_at"]
    plan = t.get("plan") or {}
    out = [("detected", 0.0, f"{t['detected_in_s']:.1f} s after the last step" if t.get("detected_in_s") is not None
            else "")]
    for name, key, what in (("diagnosed", "diagnosed_at", f"verdict {t.get('verdict') or '-'}"),
                            ("decided", "decided_at", f"{t.get('action') or '-'}"),
                            ("restarted", "remediated_at", f"from step {t.get('resume_step')}"
                             + (f" on {', '.join(plan['nodes'])}" if plan.get("nodes") else "")),
                            ("recovered", "recovered_at", f"training again at step {t.get('first_step_after')}; "
                             f"{t.get('lost_steps')} step(s) lost"),
                            ("resolved", "resolved_at", "")):
        if t.get(key) is not None and not (name == "resolved" and t.get("recovered_at") == t.get("resolved_at")):
            out.append((name, t[key] - detected, what))
    return out
