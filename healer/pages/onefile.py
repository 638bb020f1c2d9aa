"""The single-file run report (`megaheal report RUN_DIR --html FILE`, and RUN_DIR/report.html after `megaheal run`):
the job page, the incident list and every incident page of one run, in one HTML file that loads nothing from
anywhere (its policy is `default-src 'none'`), to attach to a post-mortem. It ends with the commands to run next,
each with why."""

from __future__ import annotations

import shlex
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy.engine import Engine

from healer.pages.render import report_file
from healer.pages.views import IncidentView, JobView, Sources, incident_view, job_ledger, job_view

OPEN = frozenset({"open", "diagnosing", "remediating", "escalated", "acknowledged"})
"""States in which an incident still wants a person's look."""


def next_steps(run_dir: Path, job: JobView, incidents: list[IncidentView]) -> list[tuple[str, str]]:
    """(command, why) of what to run next on this run, from what it shows: always the report and the trace; the
    incidents still open; the hosts left out, to diagnose before they come back; taking the run over where its
    last attempt never ended."""
    run = shlex.quote(str(run_dir))
    out = [(f"megaheal report {run}", "print the incidents and the goodput ledger, and write report.json"),
           (f"megaheal timeline {run} -o trace.json", "every rank's steps and phases, to open in ui.perfetto.dev"),
           (f"megaheal ckpt list {run}", "the checkpoints a restart can resume from")]
    for view in incidents:
        i = view.incident
        if i["state"] in OPEN:
            out.append((f"megaheal incidents show {i['id']} --run-dir {run}",
                        f"incident {i['id']} ({i['kind']}) is {i['state']}: its story, decision and evidence"))
    left = sorted({n for a in job.attempts if isinstance(a, dict) for n in a.get("excluded") or []}
                  | {n for v in incidents for r in v.restarts for n in r.get("excluded") or []})
    if left:
        out.append((f"megaheal diagnose node-health --nodes {shlex.quote(','.join(left))}",
                    f"{', '.join(left)} left the job: check before giving {'them' if len(left) > 1 else 'it'} back"))
    attempts = job.attempts
    if job.ledger.run is not None and attempts and getattr(attempts[-1], "ended_at", 0) is None:
        out.append((f"megaheal run --run-dir {run} --take-over",
                    f"attempt {attempts[-1].number} never ended: take the run over from the healer that drove it"))
    return out


def write_report(run_dir: Path, engine: Engine, job: str, out: Path) -> Path:
    """Write the report of `run_dir` (whose job is `job`, its incidents in `engine`) to `out`; returns `out`."""
    src = Sources(engine=engine, run_dir=run_dir)
    ledger = job_ledger(src, job)
    view = job_view(src, job, ledger)
    incidents = [incident_view(src, row.id, ledger) for row in reversed(view.incidents.rows)]
    html = report_file(view, incidents, datetime.now(UTC), next_steps(run_dir, view, incidents))
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)  # NOTE: whole or not at all: a reader never opens half a report
    return out
