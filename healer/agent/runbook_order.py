"""A runbook order carried out on the agent's host: `megaheal diagnose` in its own process group, under the order's
timeout (a timeout takes down whatever the runbook started too), its output kept to a bound."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

from wire.orders import RunbookOrder, RunbookRun

# The last characters of each stream a result carries (the JSON report is the whole of stdout).
STDOUT_KEPT = 200_000
STDERR_KEPT = 20_000


def run_runbook_order(order: RunbookOrder, *, python: str, node: str, cwd: Path,
                      env: Mapping[str, str]) -> RunbookRun:
    """`order`'s runbook for `node`, run with `python` in `cwd` and environment `env`."""
    argv = [python, "-m", "megaheal", "diagnose", order.runbook, "--nodes", node, "--json"]
    with subprocess.Popen(argv, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=order.timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return RunbookRun(returncode=None, stdout="", stderr=f"ran past {order.timeout_s:g} s", timeout=True)
    return RunbookRun(returncode=proc.returncode, stdout=out[-STDOUT_KEPT:], stderr=err[-STDERR_KEPT:])
