"""Rendering the pages: one Jinja environment (autoescaping every value, undefined names an error), the
Content-Security-Policy that goes with it, and the two ways the same templates are used:

- served (healer/service/pages.py): one page per URL, links between them, ack and resolve forms;
- one file (`megaheal report --html`): the job, its incidents and every incident in one document, linked by
  anchors, with the policy in a <meta> element: `default-src 'none'`, so nothing the file holds can load anything.

The stylesheet is inlined (a file has nowhere else to take it from) and allowed by its hash, so neither needs
'unsafe-inline'. No page has a script, and the policy allows none.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from healer.ledger.objective import RECORDED
from healer.ledger.objective import label as window_label
from healer.ledger.objective import lines as ledger_lines
from healer.pages.axes import LABEL_ROW_H, duration
from healer.pages.cost import PARTS, Cost
from healer.pages.evidence import hang_evidence, phase_evidence
from healer.pages.reruns import rerun_sentences
from healer.pages.story import decision_of, decision_sentences, headline, lost_steps, status_said
from healer.pages.views import STATES, Filters, IncidentList, IncidentView, JobView, stage_lengths, stage_list


@cache
def stylesheet() -> str:
    css = resources.files("healer.pages").joinpath("pages.css").read_text()
    if "</" in css:
        raise ValueError("pages.css must not contain '</' (it is inlined in a <style> element)")
    return css


def style_hash() -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(stylesheet().encode()).digest()).decode()


def csp(served: bool) -> str:
    """The policy: nothing but the inline stylesheet and the icon (`data:`, so the browser asks no server for one).
    NOTE: frame-ancestors only counts in a header (a <meta> policy that names it gets a console error)."""
    common = f"default-src 'none'; style-src '{style_hash()}'; img-src data:; base-uri 'none'"
    return f"{common}; form-action 'self'; frame-ancestors 'none'" if served else f"{common}; form-action 'none'"


SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
                    "Cache-Control": "no-store"}


@dataclass(frozen=True, slots=True)
class ServedLinks:
    """URLs of the served pages. Job names are URL-quoted: they come from the database, from any heartbeat."""

    served: bool = True

    def incidents(self, **filters: str) -> str:
        query = urlencode({k: v for k, v in filters.items() if v})
        return "/incidents" + (f"?{query}" if query else "")

    def incident(self, incident_id: int) -> str:
        return f"/incidents/{incident_id}"

    def action(self, incident_id: int, verb: str) -> str:
        return f"/incidents/{incident_id}/{verb}"

    def job(self, job: str) -> str:
        return f"/jobs/{quote(job, safe='')}"

    def trace(self, job: str) -> str | None:
        return f"/jobs/{quote(job, safe='')}/trace.json"


@dataclass(frozen=True, slots=True)
class FileLinks:
    """Anchors inside the one file."""

    served: bool = False

    def incidents(self, **filters: str) -> str:
        return "#incidents"

    def incident(self, incident_id: int) -> str:
        return f"#incident-{incident_id}"

    def action(self, incident_id: int, verb: str) -> str:
        return "#"

    def job(self, job: str) -> str:
        return "#job"

    def trace(self, job: str) -> str | None:
        return None  # NOTE: the file stays one file; `megaheal timeline RUN_DIR` writes the trace


# ---- filters ---------------------------------------------------------------------------------------------------

def when(value: datetime | float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if isinstance(value, (int, float)):
        value = datetime.fromtimestamp(value, UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def gpu_time(cost: Cost | None) -> str:
    """Lost GPU-time as a person reads it: GPU-seconds, or GPU-hours past one."""
    if cost is None or cost.gpu_seconds is None:
        return "-" if cost is None else f"{duration(cost.total_s)} x ? ranks"
    g = cost.gpu_seconds
    return f"{g / 3600:.2f} GPU-h" if g >= 3600 else f"{g:.0f} GPU-s"


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def number(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}" if math.isfinite(value) else str(value)
    return "-" if value is None else str(value)


def percent(ratio: float | None, digits: int = 1) -> str:
    """0.2879 as 28.8%."""
    return "-" if ratio is None or not math.isfinite(ratio) else f"{100 * ratio:.{digits}f}%"


@cache
def environment() -> Environment:
    env = Environment(loader=PackageLoader("healer.pages", "templates"), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    env.filters.update(when=when, dur=duration, gpu=gpu_time, pretty=pretty, number=number, status_said=status_said,
                       lost_steps=lost_steps, window=window_label, percent=percent)
    env.globals.update(cost_parts=PARTS, states=STATES, stage_list=stage_list, stage_lengths=stage_lengths,
                       headline=headline, decision_of=decision_of, decision_sentences=decision_sentences,
                       hang_evidence=hang_evidence, phase_evidence=phase_evidence,
                       rerun_sentences=rerun_sentences, row_h=LABEL_ROW_H, ledger_lines=ledger_lines,
                       recorded=RECORDED)
    return env


def _page(template: str, served: bool, title: str, **context: Any) -> str:
    # NOTE: Markup only for the stylesheet (our own file, checked above); every other value is escaped.
    return environment().get_template(template).render(
        title=title, css=Markup(stylesheet()), meta_csp=None if served else csp(False),
        links=ServedLinks() if served else FileLinks(), **context)


# ---- pages -----------------------------------------------------------------------------------------------------

def incidents_page(found: IncidentList) -> str:
    return _page("incidents.html", True, "incidents", found=found)


def incident_page(view: IncidentView) -> str:
    i = view.incident
    return _page("incident.html", True, f"incident {i['id']}: {i['kind']}", view=view)


def job_page(view: JobView) -> str:
    return _page("job.html", True, f"job {view.job}", view=view)


def error_page(status: int, message: str) -> str:
    return _page("error.html", True, f"{status}", status=status, message=message)


def report_file(job: JobView, incidents: list[IncidentView], generated: datetime,
                commands: list[tuple[str, str]] | None = None) -> str:
    """The single-file report of one run; `commands`: (command, why) to run next (healer.pages.onefile)."""
    return _page("report.html", False, f"run report: {job.job}", view=job, incidents=incidents,
                 generated=generated, filters=Filters(job=job.job), commands=commands or [])
