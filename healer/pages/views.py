"""What each page shows, read from the healer's database and, where the job's run directory is known, from the
files the run left there. Nothing here writes, and nothing here renders.

Where the run directory is known (the single-file report; the service with `run_roots`), the goodput ledger is
computed from it (healer.ledger.goodput, exactly as `megaheal report` does) and the heat map and the loss plot are
drawn from the ranks' step records. Without it the ledger is the one `megaheal run` wrote into the database
(goodput_intervals), and the pages say what they cannot show. A listing's rows (the incidents page, a job's page) take
their costs from the database's ledger first, where it holds their job's: read for those rows alone, since a page of
100 rows must not compute the whole ledger of every job it names; a served incident's page reads its own in the
same way (incident_ledger). Both are judged against the job's ETTR objective (healer.ledger.objective): the run
directory's where known, else the defaults; a job at the end of its ledger, an incident when it was over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ground.typedconfig import ConfigError
from healer.decide.states import IncidentState
from healer.incidents.jobstore import JobStore
from healer.incidents.models import GoodputInterval, Incident, Remediation, Restart
from healer.incidents.store import IncidentStore
from healer.incidents.timeline import job_timelines, suspects
from healer.ledger.goodput import CATEGORIES, KINDS, Interval, compute, intervals
from healer.ledger.objective import RECORDED, Objective, Standing, read_objective, standing
from healer.pages import heatmap, lossplot, waterfall
from healer.pages.cost import SAME_START_S, SLOWDOWN_KINDS, Cost, incident_costs, slowdown
from healer.pages.hosts import host_table
from healer.pages.rundir import RunDir, find_run_dir
from healer.pages.story import lost_steps

log = logging.getLogger(__name__)
STATES = tuple(s.value for s in IncidentState)
PAGE_SIZE = 100
"""Incidents on one served page (the list, a job's); older ones are a link away (`offset`)."""
REPORT_SIZE = 1000
"""Incidents in the single-file report of one run."""


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
    whole: bool = True
    """Whether `timelines` and `costs` hold every incident of the job; False: a served job page's ledger from the
    database, which reads only what it draws (the costs of the incidents it lists come from `row_costs`), or an
    incident page's (incident_ledger: that incident's alone)."""
    marks: list[tuple[int, str, float]] = field(default_factory=list)
    """(id, kind, detected_at) of each incident of the job, for the time line."""
    objective: Objective | None = None
    """The job's ETTR objective (job_objective); None where its run directory's file is not one."""
    objective_note: str = ""
    """Where the objective comes from, when not from the run directory, or why there is none."""
    standing: Standing | None = None
    """The job against its objective at the end of its ledger; None without a ledger or a step in it."""


def job_ledger(src: Sources, job: str, whole: bool = True) -> JobLedger:
    """The job's goodput ledger: computed from its run directory where known (that needs every incident's timeline),
    else the one in the database. `whole=False` (a served page): from the database, no incident's timeline is read."""
    run = src.run_for(job)
    whole = whole or (run is not None and bool(run.attempts()))
    timelines = [t.to_payload() for t in job_timelines(src.engine, job)] if whole else []
    out = JobLedger(job=job, source=None, run=run, timelines=timelines, whole=whole)
    if run is not None and run.attempts():
        ledger = compute(run.path, timelines)
        out.source, out.timelines, out.spans = "run directory", ledger.incidents, intervals(run.path, timelines)
        out.seconds, out.wall_s, out.ettr = ledger.seconds, ledger.wall_s, ledger.ettr
        out.steps_done, out.lost_steps = ledger.steps_done, ledger.lost_steps
    else:
        out.spans = [_interval(r) for r in JobStore(src.engine).intervals(job)]
        if out.spans:
            out.source = "database"
            out.seconds = dict.fromkeys(CATEGORIES, 0.0)
            for s in out.spans:
                out.seconds[CATEGORIES[KINDS.index(s.kind)] if s.kind in KINDS else "other"] += s.seconds
            out.wall_s = out.spans[-1].end - out.spans[0].start
            out.ettr = out.seconds["productive"] / out.wall_s if out.wall_s > 0 else None
    out.objective, out.objective_note = job_objective(run)
    out.standing = standing(out.spans, out.objective) if out.objective is not None else None
    if not whole:
        with Session(src.engine) as session:
            out.marks = [(i, kind, at.timestamp()) for i, kind, at in session.execute(
                select(Incident.id, Incident.kind, Incident.opened_at).where(Incident.job == job)
                .order_by(Incident.id))]
        return out
    out.marks = [(t["id"], t["kind"], t["detected_at"]) for t in out.timelines]
    restarts = [(r.incident_id, r.started_at.timestamp()) for r in JobStore(src.engine).restarts(job)
                if r.incident_id is not None and r.started_at is not None]
    # No ledger, no cost: a page says "-" rather than a zero it does not know.
    out.costs = with_slowdowns(run, out.timelines, incident_costs(
        out.spans, restarts, {t["id"]: _ranks(run, t) for t in out.timelines})) if out.spans else {}
    return out


def job_objective(run: RunDir | None) -> tuple[Objective | None, str]:
    """The job's objective, as its run recorded it, and a note on where it comes from when it is not from there."""
    if run is None:
        return Objective(), ("the default: the job's run directory, where megaheal run records the job's objective, "
                             "is not known to this healer")
    try:
        found = read_objective(run.path)
    except ConfigError:
        # NOTE: the page does not name the file (a served page shows no server path); the log and the report do.
        log.warning("the job's objective is not judged on its pages", exc_info=True)
        return None, "the run's launcher/objective.json is not an objective (megaheal report RUN_DIR says why)"
    return found, "" if found.source == RECORDED else "the default: the run recorded none"


def with_slowdowns(run: RunDir | None, incidents: list[dict[str, Any]], costs: dict[int, Cost]) -> dict[int, Cost]:
    """`costs` with each straggler-like incident's Slowdown (healer.pages.cost.slowdown) where the run directory is
    known; `incidents`: id, kind, attempt, detected_at, resolved_at and evidence of each (timeline payloads)."""
    if run is None:
        return costs
    ranks = run.rank_numbers()
    for inc in incidents:
        if inc["kind"] not in SLOWDOWN_KINDS or inc["id"] not in costs or not ranks:
            continue
        attempt = run.attempt(inc.get("attempt")) or run.attempt_at(inc["detected_at"])
        if attempt is None:
            continue
        records = [r for r in run.records(ranks[0]) if r.time - r.step_seconds >= attempt.started_at
                   and (attempt.ended_at is None or r.time <= attempt.ended_at)]
        found = slowdown(records, inc, attempt.ended_at)
        if found is not None:
            costs[inc["id"]] = replace(costs[inc["id"]], slowdown=found)
    return costs


def _interval(r: GoodputInterval) -> Interval:
    return Interval(r.kind, r.started_at.timestamp(), r.ended_at.timestamp(), r.incident_id, r.steps)


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
    limit: int = PAGE_SIZE
    """Rows on a page: the older and newer links step by it."""


def incident_list(src: Sources, filters: Filters, offset: int = 0, limit: int = PAGE_SIZE,
                  ledgers: dict[str, JobLedger] | None = None) -> IncidentList:
    """Newest first, `limit` from `offset`: the page's rows (and one more, to know whether there are older ones) are
    all it reads, in a fixed number of statements however many incidents there are. `ledgers`: jobs' whole ledgers
    the caller has already (an incident's cost is its job's); the other rows' costs come from `row_costs`."""
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
    shown = found[:limit]
    known = {job: ledger for job, ledger in (ledgers or {}).items() if ledger.whole}
    costs = row_costs(src, [i for i in shown if i.job not in known])
    rows = []
    for i in shown:
        ranks, nodes = suspects(i.id, i.suspects, i.node)
        cost = known[i.job].costs.get(i.id) if i.job in known else costs.get(i.id)
        rows.append(Row(i.id, i.kind, i.state, i.severity, i.job, i.node, i.summary, i.opened_at, ranks, nodes, cost))
    return IncidentList(rows, filters, offset, len(found) > limit, choices, limit)


def row_costs(src: Sources, incidents: list[Incident]) -> dict[int, Cost]:
    """The cost of each of `incidents` (a page's rows) that has one. From the database's ledger where it holds the
    job's (`megaheal run` writes it: healer/ledger/store.py), reading only these incidents' intervals and the
    startups of their restarts; else, where the job's run directory is known, from the job's whole ledger computed
    from it (job_ledger). NOTE: not a whole ledger per job from the database: a page of 100 jobs read every incident
    of each, with its events, in 5 statements a job."""
    with_job = [i for i in incidents if i.job]
    out = _database_costs(src, with_job) if with_job else {}
    for job in sorted({i.job for i in with_job if i.id not in out and i.job}):
        run = src.run_for(job)
        if run is not None and run.attempts():
            ledger = job_ledger(src, job)
            out.update({i.id: ledger.costs[i.id] for i in with_job if i.job == job and i.id in ledger.costs})
    return out


def _database_costs(src: Sources, incidents: list[Incident]) -> dict[int, Cost]:
    """Costs from the database's ledger, of the incidents whose jobs have one there; 4 statements at most."""
    job_of = {i.id: i.job for i in incidents}
    with Session(src.engine) as session:
        ledgered = set(session.execute(select(GoodputInterval.job).distinct()
                                       .where(GoodputInterval.job.in_(set(job_of.values())))).scalars())
        mine = [i for i in incidents if i.job in ledgered]
        if not mine:
            return {}
        ids = [i.id for i in mine]
        spans = {r.id: r for r in session.execute(select(GoodputInterval).where(GoodputInterval.incident_id.in_(ids)))
                 .scalars() if r.incident_id is not None and r.job == job_of[r.incident_id]}
        restarts = [(job, i, at) for job, i, at in session.execute(
            select(Restart.job, Restart.incident_id, Restart.started_at).where(
                Restart.incident_id.in_(ids), Restart.started_at.is_not(None)))
                    if i is not None and at is not None and job == job_of[i]]
        if restarts:
            spans |= {r.id: r for r in session.execute(select(GoodputInterval).where(
                GoodputInterval.kind == "startup", or_(*(_starting(job, at) for job, _, at in restarts)))).scalars()}
    out: dict[int, Cost] = {}
    for job in {r.job for r in mine if r.job}:
        run = src.run_for(job)
        costs = incident_costs([_interval(r) for r in spans.values() if r.job == job],
                               [(i, at.timestamp()) for j, i, at in restarts if j == job],
                               {i.id: _ranks(run, {"attempt": i.attempt, "evidence": i.evidence})
                                for i in mine if i.job == job})
        out |= with_slowdowns(run, [{"id": i.id, "kind": i.kind, "attempt": i.attempt,
                                     "detected_at": i.opened_at.timestamp(), "resolved_at": _ts(i.resolved_at),
                                     "evidence": i.evidence if isinstance(i.evidence, dict) else {}}
                                    for i in mine if i.job == job], costs)
    return out


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def _starting(job: str, at: datetime) -> Any:
    """The job's intervals that start when `at` does (as incident_costs matches a startup to its restart)."""
    same = timedelta(seconds=SAME_START_S)
    return and_(GoodputInterval.job == job, GoodputInterval.started_at.between(at - same, at + same))


def incident_count(src: Sources, job: str) -> int:
    with Session(src.engine) as session:
        return int(session.execute(select(func.count()).select_from(Incident).where(Incident.job == job)).scalar_one())


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
    standing: Standing | None = None
    """The job against its objective when this incident was over (standing_at)."""


def incident_view(src: Sources, incident_id: int, ledger: JobLedger | None = None) -> IncidentView:
    """Raises healer.errors.NotFound. `ledger`: the job's, when the caller has it already (the report); else what
    this incident's page needs of it (incident_ledger)."""
    incident = IncidentStore(src.engine, "pages").get(incident_id)
    job = incident["job"]
    ledger = ledger or (incident_ledger(src, job, incident_id) if job else None)
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
                    for r in session.execute(select(Restart).where(
                        Restart.job == job, Restart.incident_id == incident_id).order_by(Restart.id)).scalars()] \
            if job else []
    cost = ledger.costs.get(incident_id) if ledger else None
    return IncidentView(incident, timeline, remediations, restarts, cost, heat, note, ranks, nodes,
                        _grafana(src.grafana_url, incident), ledger is not None and ledger.run is not None,
                        standing_at(ledger, cost, timeline))


def standing_at(ledger: JobLedger | None, cost: Cost | None, timeline: dict[str, Any] | None) -> Standing | None:
    """The job against its objective when the incident was over: when its last second in the ledger ended, else
    (charged none: a straggler the job trained through) when it was detected."""
    if ledger is None or ledger.objective is None or not ledger.spans:
        return None
    at = cost.until if cost is not None and cost.until is not None else (timeline or {}).get("detected_at")
    return standing(ledger.spans, ledger.objective, at) if at is not None else None


def incident_ledger(src: Sources, job: str, incident_id: int) -> JobLedger:
    """The job's ledger as far as one incident's served page shows it, in statements that do not grow with the job's
    incidents: the incident's own timeline (with its stage lengths from the run directory, where known: they depend
    on the run's files and this incident alone) and its cost from the database's ledger, where that holds the job's
    (read as `row_costs` reads a listing's), with the job's intervals for its standing against its objective. NOTE:
    where only the run directory holds the ledger, an incident's cost depends on every other's (where two claim the
    same time, the older incident gets it: healer/ledger/goodput.py), so that case computes the job's whole ledger
    (job_ledger), reading every incident's timeline."""
    run = src.run_for(job)
    ran = run is not None and bool(run.attempts())
    with Session(src.engine) as session:
        row = session.get(Incident, incident_id)
    costs = _database_costs(src, [row]) if row is not None else {}
    if incident_id not in costs and ran:
        return job_ledger(src, job)
    timelines = [t.to_payload() for t in job_timelines(src.engine, job, ids=[incident_id])]
    if run is not None and ran:
        timelines = compute(run.path, timelines).incidents
    # NOTE: the job's intervals, for its standing when the incident was over: one statement, whatever its incidents.
    spans = [_interval(r) for r in JobStore(src.engine).intervals(job)] if costs else []
    objective, note = job_objective(run)
    return JobLedger(job=job, source="database" if costs else None, run=run, timelines=timelines, spans=spans,
                     costs=costs, whole=False, objective=objective, objective_note=note)


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
    """The newest of the job's incidents (a page; the report: up to REPORT_SIZE)."""
    incident_count: int = 0
    """All of the job's incidents."""
    hosts: list[dict[str, Any]] = field(default_factory=list)
    """healer.pages.hosts rows where the run directory is known."""


def job_view(src: Sources, job: str, ledger: JobLedger | None = None, limit: int = REPORT_SIZE) -> JobView:
    """`limit`: the newest incidents listed (a served page: PAGE_SIZE, with a link to the older ones)."""
    ledger = ledger or job_ledger(src, job, whole=False)
    fall = waterfall.waterfall(ledger.seconds, ledger.wall_s) if ledger.seconds else None
    run = ledger.run
    attempts: list[Any] = run.attempts() if run is not None else [
        {"attempt": r.attempt, "started_at": r.started_at, "nodes": r.nodes, "excluded": r.excluded, "dp": r.dp,
         "resume": r.resume, "outcome": r.outcome, "incident": r.incident_id} for r in JobStore(src.engine).restarts(job)]
    listed = incident_list(src, Filters(job=job), limit=limit, ledgers={job: ledger})
    return JobView(job, ledger, fall, waterfall.strip(ledger.spans, ledger.marks),
                   lossplot.build(run, ledger.marks) if run is not None else None, attempts, listed,
                   incident_count(src, job),
                   host_table(run.path, ledger.timelines) if run is not None else [])


def stage_list(t: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(stage, wall-clock seconds after detection, what) of the stages the incident went through, in order."""
    detected = t["detected_at"]
    plan = t.get("plan") or {}
    step = t.get("resume_step")
    out = [("detected", 0.0, f"{t['detected_in_s']:.1f} s after the last step" if t.get("detected_in_s") is not None
            else "")]
    for name, key, what in (("diagnosed", "diagnosed_at", f"verdict in: {t.get('verdict') or '-'}"),
                            ("decided", "decided_at", f"{t.get('action') or '-'}"),
                            ("restarted", "remediated_at", ("from the newest checkpoint" if step is None
                                                            else f"from step {step}")
                             + (f" ({t['restart_mode']})" if t.get("restart_mode") else "")
                             + (f" on {', '.join(plan['nodes'])}" if plan.get("nodes") else "")),
                            ("recovered", "recovered_at", "training again" + (
                                f" at step {t['first_step_after']}" if t.get("first_step_after") is not None else "")
                             + f"; {lost_steps(t.get('lost_steps'))}"),
                            ("resolved", "resolved_at", "")):
        if t.get(key) is not None and not (name == "resolved" and t.get("recovered_at") == t.get("resolved_at")):
            out.append((name, t[key] - detected, what))
    return out


def stage_lengths(t: dict[str, Any] | None) -> dict[str, float | None]:
    """Per cost part, how long the incident's stage lasted by the wall clock (the stage list's times): detection
    from the last step to detection, diagnosis from detection to the decision, restart from the decision to the new
    attempt's start; None where the stage has no length of its own (lost work, startup) or did not happen."""
    if t is None:
        return {}
    detected, decided, restarted = t["detected_at"], t.get("decided_at"), t.get("remediated_at")
    return {"detection": t.get("detected_in_s"),
            "diagnosis": decided - detected if decided is not None else None,
            "restart": restarted - decided if restarted is not None and decided is not None else None,
            "lost": None, "startup": None}
