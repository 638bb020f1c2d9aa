"""`megaheal report RUN_DIR`: the incident table and the goodput ledger of a supervised run, and the run against
its ETTR objective (healer/ledger/objective.py: met or missed, the error budget spent, the burn rate over the last
hour and 6 hours), printed with rich and written as JSON to `<run_dir>/report.json`; with `--html FILE`, also the
run's pages (healer/pages/) as one self-contained HTML file. The incidents come from the healer's store (by default
the SQLite database `megaheal run` keeps in the run directory), the times from the run's journals, the objective
from `launcher/objective.json` (the defaults where the run recorded none)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import URL, make_url
from sqlalchemy.exc import ArgumentError

from healer.incidents.db import ensure_schema, make_engine
from healer.incidents.timeline import job_timelines
from healer.ledger.goodput import Ledger, compute, intervals
from healer.ledger.objective import RECORDED, Objective, Standing, label, lines, read_objective, standing
from healer.pages.axes import duration
from healer.pages.hosts import host_table
from wire.journal import Journal
from wire.run_paths import RunPaths


def run_job_name(run_dir: Path) -> str:
    """The job a supervised run ran (its attempts' journal says); ValueError when it has none."""
    job = Journal.of(RunPaths(run_dir).journal).job()
    if job is None:
        raise ValueError(f"{run_dir}: no attempts' journal (launcher/attempts.jsonl): not a supervised run")
    return job


READ_TIMEOUT = timedelta(seconds=60)
"""The longest one of the report's reads may take on PostgreSQL: a database that stopped answering is an error."""


def default_db_url(run_dir: Path) -> str:
    return RunPaths(run_dir).database_url


def _existing_store(run_dir: Path, db_url: str | None) -> tuple[str, str]:
    """The run's job and the URL of its database, once both are known to be there; ValueError naming what is
    missing otherwise. NOTE: checked before an engine is made: SQLite creates a missing file, and its directory, on
    first use, so a mistyped path would have left an empty database behind and asked for a migration."""
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such run directory")
    job = run_job_name(run_dir)
    url = db_url or default_db_url(run_dir)
    parsed = _url_or_none(url)
    if parsed is not None and parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        path = Path(parsed.database).expanduser()
        if not path.is_file():
            given = "--db" if db_url else "the run's database"
            raise ValueError(f"{path}: no such database ({given}); megaheal run keeps its incidents in "
                             "RUN_DIR/healer.db unless it was given --db")
    return job, url


def _url_or_none(url: str) -> URL | None:
    """`url` parsed, or None when it is not a URL (make_engine then says so)."""
    try:
        return make_url(url)
    except ArgumentError:
        return None


def load_incidents(run_dir: Path, db_url: str | None = None, password: str | None = None) -> list[dict[str, Any]]:
    """The run's incidents as timeline payloads, from `db_url` (default: the run directory's database). ValueError
    when the run directory, its journal or a SQLite database is not there (nothing is created)."""
    job, url = _existing_store(run_dir, db_url)
    engine = make_engine(url, READ_TIMEOUT, password)
    try:
        ensure_schema(engine, create_if_empty=False)
        return [t.to_payload() for t in job_timelines(engine, job)]
    finally:
        engine.dispose()


def write_html(run_dir: Path, out: Path, db_url: str | None = None, password: str | None = None) -> Path:
    """The single-file HTML report of the run (healer.pages.onefile) at `out`; returns its absolute path."""
    from healer.pages.onefile import write_report

    job, url = _existing_store(run_dir, db_url)
    engine = make_engine(url, READ_TIMEOUT, password)
    try:
        ensure_schema(engine, create_if_empty=False)
        return write_report(run_dir, engine, job, out).absolute()
    finally:
        engine.dispose()


def _s(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "-"


def render(ledger: Ledger, said: list[str] | None = None) -> None:
    """`said`: the run against its objective (objective_said), printed under its ETTR."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 180)  # the incident table is wide; a pipe or CI log has 80 columns
    table = Table(title="incidents")
    for col in ("#", "kind", "suspect", "detected in", "diagnosed in", "recovered in", "lost steps", "action",
                "verdict", "state", "what happened"):
        table.add_column(col, overflow="fold")
    for inc in ledger.incidents:
        suspect = ", ".join([*(f"rank {r}" for r in inc.get("suspect_ranks", [])), *inc.get("suspect_nodes", [])])
        verdict = inc.get("verdict") or (inc.get("plan") or {}).get("decision_basis", {}).get("verdict")
        bad = (inc.get("plan") or {}).get("decision_basis", {}).get("verdict_bad_nodes") or []
        if verdict and bad:
            verdict = f"{verdict} ({', '.join(bad)})"
        action = inc.get("action") or "-"
        if inc.get("restart_mode"):
            action = f"{action} ({inc['restart_mode']})"
        table.add_row(str(inc["id"]), inc["kind"], suspect or "-", _s(inc.get("detected_in_s")),
                      _s(inc.get("diagnosed_in_s")), _s(inc.get("recovered_in_s")),
                      str(inc.get("lost_steps") if inc.get("lost_steps") is not None else "-"), action, verdict or "-", inc.get("state", "-"), str(inc.get("summary", ""))[:90])
    console.print(table)
    split = Table(title=f"goodput: wall {ledger.wall_s:.1f} s, {ledger.steps_done} steps, {ledger.attempts} attempt(s)")
    split.add_column("where the time went (losses: largest first)")
    split.add_column("seconds", justify="right")
    split.add_column("share", justify="right")
    for name, value, share in lines(ledger.seconds, ledger.wall_s):
        split.add_row(name, f"{value:.1f}", f"{100 * share:.1f}%" if ledger.wall_s else "-")
    console.print(split)
    console.print(f"ETTR (productive / wall): [bold]{100 * ledger.ettr:.1f}%[/bold]")
    for line in said or []:
        console.print(line, markup=False, highlight=False)
    if ledger.degraded_s:
        console.print(f"degraded (trained on fewer ranks than the job's most, within productive): "
                      f"{ledger.degraded_s:.1f} s")
    modes = restart_modes(ledger.incidents)
    if any(modes.values()):
        console.print("restarts: " + ", ".join(f"{n} {mode}" for mode, n in modes.items()) + "; "
                      + "; ".join(f"#{i['id']} {i['restart_mode']}: {i['restart_why']}"
                                  for i in ledger.incidents if i.get("restart_mode")))


def objective_said(objective: Objective, judged: Standing | None) -> list[str]:
    """The run against its objective, in lines of text (the report's; the pages say the same in their words)."""
    cfg = objective.cfg
    where = "the run's own" if objective.source == RECORDED else "the default: the run recorded none"
    head = f"objective: ETTR >= {100 * cfg.ettr_target:.1f}% over {label(cfg.ettr_window.total_seconds())} ({where})"
    if judged is None:
        return [(f"{head}: not judged: the run trained no step (a program that writes no step records has no "
                 "productive time the ledger knows of)")]
    over = (f"the run's {duration(judged.judged_s)} (shorter than the window)" if judged.judged_s < judged.window_s
            else f"the last {label(judged.window_s)}")
    verdict = "met" if judged.met else "missed"
    budget = f"{duration(judged.budget * judged.judged_s)} of {duration(judged.judged_s)}"
    out = [head,
           f"  ETTR {100 * judged.ettr:.1f}% over {over}: {verdict} by {abs(judged.points):.1f} points",
           (f"  error budget {100 * judged.budget:.1f}% ({budget}): {duration(judged.unproductive_s)} not "
            f"productive, {100 * judged.spent:.0f}% of it spent"),
           "  burn rate (1 spends the budget exactly over the window): "
           + ", ".join(f"{label(b.window_s)} {b.rate:.3g}" for b in judged.burns)]
    short = [label(b.window_s) for b in judged.burns if b.short]
    if short:
        out.append(f"    the run had {duration(judged.burns[0].seen_s)} since its first step, less than "
                   f"{' and '.join(short)}: the rest of the window counts productive, as Prometheus's rules count it")
    return out


def objective_payload(objective: Objective, judged: Standing | None) -> dict[str, Any]:
    return {"ettr_target": objective.cfg.ettr_target, "ettr_window_s": objective.cfg.ettr_window.total_seconds(),
            "source": objective.source, "standing": judged.to_payload() if judged is not None else None}


def restart_modes(incidents: list[dict[str, Any]]) -> dict[str, int]:
    """How many of the incidents' restarts were warm and how many cold."""
    return {mode: sum(i.get("restart_mode") == mode for i in incidents) for mode in ("warm", "cold")}


def render_hosts(hosts: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 180)
    table = Table(title="hosts")
    for col in ("host", "role by attempt", "incidents", "drained", "slurm at the end", "network"):
        table.add_column(col, overflow="fold")
    for h in hosts:
        roles = ", ".join(f"{a}: {r}" for a, r in h["roles"].items())
        named = ", ".join(f"#{i['id']} {i['kind']}" for i in h["incidents"])
        drain = h["drain"]
        drained = "-" if drain is None else (drain["reason"] if drain.get("drained") else f"no: {drain.get('error')}")
        slurm = h["slurm"]
        state = "-" if not slurm else f"{slurm.get('state')}" + (f" ({slurm['reason']})" if slurm.get("reason") else "")
        failed = [f"preflight: {s['summary']}" for s in h.get("screening", []) if s["status"] == "fail"]
        table.add_row(h["host"], roles or "-", ", ".join([*failed, *([named] if named else [])]) or "-", drained,
                      state, "; ".join(h["network"]) or "-")
    console.print(table)


def report(run_dir: Path, incidents: list[dict[str, Any]], quiet: bool = False,
           chaos: dict[str, Any] | None = None, objective: Objective | None = None) -> Ledger:
    """`chaos`: the schedule's faults that fired and those that did not (Chaos.summary), when one was played;
    `objective`: the one the run ran under [default: the run directory's, read_objective: ConfigError where its file
    is not one, before anything is written]."""
    objective = objective or read_objective(run_dir)
    ledger = compute(run_dir, incidents)
    judged = standing(intervals(run_dir, incidents), objective)
    hosts = host_table(run_dir, incidents)
    extra = {"chaos": chaos} if chaos is not None else {}
    shares = [{"category": c, "seconds": v, "share": round(share, 4)} for c, v, share in lines(ledger.seconds,
                                                                                                ledger.wall_s)]
    (run_dir / "report.json").write_text(json.dumps(ledger.to_payload() | {
        "lines": shares, "objective": objective_payload(objective, judged), "hosts": hosts,
        "restarts": restart_modes(incidents)} | extra, indent=2, default=str))
    if not quiet:
        render(ledger, objective_said(objective, judged))
        if hosts:
            render_hosts(hosts)
        if chaos is not None:
            missed = ", ".join(f"{f['kind']} at step {f['at_step']}" for f in chaos["not_fired"]) or "none"
            print(f"chaos: {len(chaos['fired'])} of {len(chaos['fired']) + len(chaos['not_fired'])} fault(s) fired; "
                  f"not fired: {missed}")
    return ledger
