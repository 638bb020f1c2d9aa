"""Diagnosing suspect hosts before a restart: each host runs a runbook (node-health by default) *on that host*,
through its node agent, while the job is stopped; the per-host verdicts become the policy's Verdict.

A node whose runbook fails is named bad (the policy leaves it out and takes a spare). A runbook that could
not run (timeout, crash, unreadable output) is an `error`: it names no node, because a healer that cannot
diagnose must not take a healthy node out of the job on a guess; the incident keeps the reason.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from healer.ports import HostVerdict
from wire.verdict import Status

RunRunbook = Callable[[str, str, float], "subprocess.CompletedProcess[str]"]
"""(host, runbook, timeout in seconds) -> `megaheal diagnose RUNBOOK --json` as it ran on that host; TimeoutError or
OSError when it could not run there."""


def diagnose_node(run: RunRunbook, node: str, runbook: str, timeout: timedelta) -> HostVerdict:
    return run_parsed(run, node, runbook, timeout)[0]


def run_parsed(run: RunRunbook, node: str, runbook: str,
               timeout: timedelta) -> tuple[HostVerdict, dict[str, Any] | None]:
    """The runbook's verdict as `node`'s, and its whole `--json` result (None when it gave none)."""
    t0 = time.monotonic()
    try:
        done = run(node, runbook, timeout.total_seconds())
    except (TimeoutError, OSError) as exc:
        return HostVerdict(node, Status.ERROR, f"{runbook} could not run: {exc}", time.monotonic() - t0), None
    seconds = time.monotonic() - t0
    try:
        result = json.loads(done.stdout)
        raw, summary = str(result["verdict"]), str(result["summary"])
    except (json.JSONDecodeError, KeyError, TypeError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return HostVerdict(node, Status.ERROR, f"{runbook} exited {done.returncode} without a result: "
                                               f"{' | '.join(tail) or 'no output'}", seconds), None
    try:
        status = Status(raw)
    except ValueError:
        return HostVerdict(node, Status.ERROR, f"{runbook} gave an unknown verdict {raw!r}", seconds), None
    # The failing steps say what is wrong; the runbook's own summary only counts them.
    bad = {Status.FAIL.value, Status.DEGRADED.value, Status.ERROR.value}
    failing = [f"{s['step']}: {s['summary']}" for s in result.get("steps", [])
               if isinstance(s, dict) and s.get("status") in bad]
    return HostVerdict(node, status, "; ".join(failing) or summary, seconds), result


def diagnose_nodes(run: RunRunbook, nodes: list[str], runbook: str, timeout: timedelta) -> list[HostVerdict]:
    """Every node at once (each is its own machine on a cluster), in `nodes` order."""
    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="megaheal-diagnose") as pool:
        return list(pool.map(lambda n: diagnose_node(run, n, runbook, timeout), nodes))

