"""The single-file run report (`megaheal report RUN_DIR --html FILE`, and RUN_DIR/report.html after `megaheal run`):
the job page, the incident list and every incident page of one run, in one HTML file that loads nothing from
anywhere (its policy is `default-src 'none'`), to attach to a post-mortem."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy.engine import Engine

from healer.pages.render import report_file
from healer.pages.views import Sources, incident_view, job_ledger, job_view


def write_report(run_dir: Path, engine: Engine, job: str, out: Path) -> Path:
    """Write the report of `run_dir` (whose job is `job`, its incidents in `engine`) to `out`; returns `out`."""
    src = Sources(engine=engine, run_dir=run_dir)
    ledger = job_ledger(src, job)
    view = job_view(src, job, ledger)
    incidents = [incident_view(src, row.id, ledger) for row in reversed(view.incidents.rows)]
    html = report_file(view, incidents, datetime.now(UTC))
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)  # NOTE: whole or not at all: a reader never opens half a report
    return out
