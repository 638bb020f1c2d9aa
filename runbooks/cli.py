"""`megaheal diagnose`: run a runbook standalone, or measure and store baselines.

Exit codes: 0 pass, 1 degraded or fail, 2 error (including a runbook or argument that is refused
before anything runs).
"""

from __future__ import annotations

import json
import sys

from rich.console import Console

from ground.typedconfig import ConfigError
from runbooks.baselines import BaselineStore, default_path
from runbooks.display import Progress, render_result
from runbooks.registry import CheckContext
from runbooks.runner import run_runbook
from runbooks.spec import load_runbook, shipped_runbooks
from wire.verdict import RunbookResult, Status

# What --calibrate measures when no runbook is named: the runbooks whose checks compare with baselines.
CALIBRATED = ("collectives-quick", "network-triage")


def split_nodes(values: list[str]) -> tuple[str, ...]:
    """--nodes a,b --nodes c -> ("a", "b", "c")."""
    return tuple(n.strip() for v in values for n in v.split(",") if n.strip())


def diagnose(
    runbook: str | None,
    nodes: list[str],
    as_json: bool,
    overrides: list[str],
    baselines: str | None,
    calibrate: bool,
    repeats: int,
) -> int:
    err = Console(stderr=True)
    try:
        ctx = CheckContext(nodes=split_nodes(nodes), baselines_path=str(baselines or default_path()))
        if calibrate:
            return _calibrate([runbook] if runbook else list(CALIBRATED), ctx, overrides, repeats, as_json, err)
        if runbook is None:
            err.print(
                "usage: megaheal diagnose RUNBOOK [--nodes a,b] [--json]; shipped runbooks: "
                + ", ".join(shipped_runbooks())
            )
            return 2
        spec = load_runbook(runbook, overrides)
        with Progress(spec, err) as progress:
            result = run_runbook(spec, ctx, on_event=progress)
    except (ConfigError, ValueError) as exc:
        err.print(f"error: {exc}", markup=False)
        return 2
    _print(result, as_json)
    return result.exit_code


def _print(result: RunbookResult, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result.to_payload(), indent=2) + "\n")
    else:
        Console().print(render_result(result))


def _calibrate(
    names: list[str], ctx: CheckContext, overrides: list[str], repeats: int, as_json: bool, err: Console
) -> int:
    """Run each runbook `repeats` times on a healthy machine and store the median of every keyed value."""
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    store = BaselineStore(ctx.baselines_path)
    ctx = CheckContext(nodes=ctx.nodes, hostname=ctx.hostname, baselines_path=ctx.baselines_path, calibrate=True)
    stored: dict[str, float] = {}
    for name in names:
        spec = load_runbook(name, overrides)
        runs = []
        for i in range(repeats):
            err.print(f"calibrating {name}: run {i + 1} of {repeats}")
            result = run_runbook(spec, ctx)
            if result.verdict in (Status.FAIL, Status.ERROR):
                # A baseline taken on a broken machine would make every later check pass.
                err.print(f"error: {name} did not pass, nothing stored: {result.summary}", markup=False)
                return result.exit_code
            runs.append(list(result.measurements))
        stored.update(store.update(runs))
    if as_json:
        sys.stdout.write(json.dumps({"baselines_path": ctx.baselines_path, "stored": stored}, indent=2) + "\n")
    else:
        Console().print(f"stored {len(stored)} baseline(s) in {ctx.baselines_path}")
    return 0
