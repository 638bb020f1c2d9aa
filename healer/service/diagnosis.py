"""Diagnosis: running an incident's runbook (runbooks/) and handing its verdict back to the store.

`LocalRunbookDiagnoser` runs runbooks on the healer's own machine, in a bounded pool of threads (each
step of a runbook is itself a separate process group under a timeout, see runbooks/runner.py). Node names
reach the runbook only through `CheckContext`, which validates them as host names; nothing from an alert
or a heartbeat is ever put into a shell command.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ground.typedconfig import ConfigError

log = logging.getLogger(__name__)

# done(verdict, summary, full result or None)
Done = Callable[[str, str, dict[str, Any] | None], None]


class Diagnoser(Protocol):
    def submit(self, runbook: str, nodes: list[str], done: Done) -> None: ...

    def shutdown(self) -> None: ...


class LocalRunbookDiagnoser:
    def __init__(self, workers: int = 2) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megaheal-runbook")

    def submit(self, runbook: str, nodes: list[str], done: Done) -> None:
        self._pool.submit(self._run, runbook, nodes, done)

    def _run(self, runbook: str, nodes: list[str], done: Done) -> None:
        try:
            verdict, summary, payload = run_local(runbook, nodes)
        except (ConfigError, ValueError, OSError) as exc:
            verdict, summary, payload = "error", f"runbook {runbook} could not run: {exc}", None
        try:
            done(verdict, summary, payload)
        except Exception:  # noqa: BLE001 - a worker thread: nothing above it would see the error
            log.error("storing the verdict of runbook %s failed", runbook, exc_info=True)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def run_local(runbook: str, nodes: list[str]) -> tuple[str, str, dict[str, Any]]:
    from runbooks.registry import CheckContext
    from runbooks.runner import run_runbook
    from runbooks.spec import load_runbook

    spec = load_runbook(runbook)
    result = run_runbook(spec, CheckContext(nodes=tuple(nodes)))
    return result.verdict.value, result.summary, result.to_payload()
