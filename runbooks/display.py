"""How `megaheal diagnose` shows a run: live step progress on stderr, then the verdict on stdout."""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from runbooks.spec import Runbook, Step
from wire.verdict import RunbookResult, Status, StepResult

STYLE = {
    Status.PASS: "green",
    Status.DEGRADED: "yellow",
    Status.FAIL: "red",
    Status.ERROR: "magenta",
    Status.SKIPPED: "dim",
}


class Progress:
    """Receives the runner's events (from several threads when steps run in parallel)."""

    def __init__(self, runbook: Runbook, console: Console) -> None:
        self._console = console
        self._lock = threading.Lock()
        self._steps = {s.name: s for s in runbook.steps}
        self._started: dict[str, float] = {}
        self._done: dict[str, StepResult] = {}
        self._title = runbook.name
        self._live: Live | None = None

    def __enter__(self) -> Progress:
        if self._console.is_terminal:
            self._live = Live(
                self._render(),
                console=self._console,
                refresh_per_second=8,
                transient=False,
                get_renderable=self._render,
            )
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def __call__(self, kind: str, step: str, payload: Any) -> None:
        with self._lock:
            if kind == "start":
                self._started[step] = time.monotonic()
                if self._live is None:
                    s: Step = payload
                    self._console.print(
                        f"[{self._title}] {step}: {s.check} started (timeout {s.timeout.total_seconds():g}s)",
                        markup=False,
                    )
            elif kind == "finish":
                self._done[step] = payload
                if self._live is None:
                    r: StepResult = payload
                    self._console.print(
                        f"[{self._title}] {step}: {r.result.status.value} in {r.seconds:.1f}s: " f"{r.result.summary}",
                        markup=False,
                    )

    def _render(self) -> Table:
        table = Table(title=f"megaheal diagnose {self._title}", title_justify="left", expand=False)
        for col in ("step", "check", "status", "s", "summary"):
            table.add_column(col)
        for name, step in self._steps.items():
            if name in self._done:
                r = self._done[name]
                status: Any = Text(r.result.status.value, style=STYLE[r.result.status])
                table.add_row(name, step.check, status, f"{r.seconds:.1f}", Text(r.result.summary, overflow="fold"))
            elif name in self._started:
                table.add_row(
                    name,
                    step.check,
                    Spinner("dots", text="running"),
                    f"{time.monotonic() - self._started[name]:.1f}",
                    "",
                )
            else:
                table.add_row(name, step.check, Text("waiting", style="dim"), "", "")
        return table


def render_result(result: RunbookResult) -> Group:
    """The verdict, the suspects and (where measured) busbw per collective and size."""
    parts: list[Any] = []
    busbw = [m for m in result.measurements if m.name == "busbw"]
    if busbw:
        sizes = sorted({int(m.labels["size"]) for m in busbw})
        table = Table(title="busbw (GB/s) per collective and message size", title_justify="left")
        table.add_column("collective")
        for size in sizes:
            table.add_column(_size(size), justify="right")
        for collective in dict.fromkeys(m.labels["collective"] for m in busbw):
            row = {int(m.labels["size"]): m for m in busbw if m.labels["collective"] == collective}
            table.add_row(collective, *(_cell(row.get(size)) for size in sizes))
        parts.append(table)
    for s in result.suspects:
        parts.append(Text(f"suspect {s.kind} {s.name}: {s.reason}", style="red"))
    parts.append(Text(f"{result.runbook}: {result.summary} ({result.seconds:.1f}s)", style=STYLE[result.verdict]))
    return Group(*parts)


def _cell(m: Any) -> str:
    if m is None:
        return "-"
    return f"{m.value:.3g}" + (f" (base {m.baseline:.3g})" if m.baseline is not None else "")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
