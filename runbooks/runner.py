"""Run a runbook: validate everything, then each step in its own process group under its timeout.

Used by `megaheal diagnose` and by the healer (which stores the returned `RunbookResult`). Each
step runs `python -m runbooks.worker` as an argument list in a new session: past its timeout the
whole group (the worker and any ranks it forked) is sent SIGTERM, then SIGKILL, and the step is
reported as error. `subprocess.run(timeout=...)` would kill only the worker and leave its ranks
running, hence Popen and killpg here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from ground.durations import to_mapping
from ground.typedconfig import ConfigError
from runbooks.registry import CheckContext, CheckRegistry, default_registry
from runbooks.spec import Runbook, Step
from wire.verdict import CheckResult, RunbookResult, Status, StepResult, worst

# NOTE: the folder megaheal's packages are imported from (the checkout, or site-packages for a wheel): a worker
# started from anywhere imports the same runbooks and checks as the runner that starts it.
IMPORT_ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 2.0

# on_event(kind, step, payload): kind "start" (payload: the Step) or "finish" (payload: StepResult).
EventHook = Callable[[str, str, Any], None]


def validate(runbook: Runbook, ctx: CheckContext, registry: CheckRegistry) -> None:
    """Context-dependent checks of every step (e.g. sizes against the node count), before any step runs."""
    for i, step in enumerate(runbook.steps):
        try:
            registry.resolve(step.check)().validate(step.config, ctx)
        except ValueError as exc:
            raise ConfigError(f"runbook {runbook.name}: steps[{i}] ({step.name}): {exc}") from exc


def run_runbook(
    runbook: Runbook,
    ctx: CheckContext | None = None,
    registry: CheckRegistry | None = None,
    on_event: EventHook | None = None,
) -> RunbookResult:
    registry = registry or default_registry()
    ctx = ctx or CheckContext()
    validate(runbook, ctx, registry)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.monotonic()
    results: list[StepResult] = []
    for batch in runbook.batches():
        if len(batch) == 1:
            results.append(_run_step(batch[0], registry, ctx, on_event))
        else:
            with ThreadPoolExecutor(max_workers=len(batch)) as pool:
                results += list(pool.map(lambda s: _run_step(s, registry, ctx, on_event), batch))
    verdict, summary = _conclude(results)
    return RunbookResult(
        runbook=runbook.name,
        verdict=verdict,
        summary=summary,
        steps=tuple(results),
        started_at=started,
        seconds=time.monotonic() - t0,
    )


def _conclude(results: list[StepResult]) -> tuple[Status, str]:
    counted = [r for r in results if r.result.status is not Status.SKIPPED]
    skipped = [r for r in results if r.result.status is Status.SKIPPED]
    if not counted:
        why = "; ".join(f"{r.step}: {r.result.summary}" for r in skipped)
        return Status.ERROR, f"error: no step could test anything on this machine ({why})"
    verdict = worst([r.result.status for r in counted])
    if verdict is Status.PASS:
        extra = f", {len(skipped)} skipped ({', '.join(r.step for r in skipped)})" if skipped else ""
        return verdict, f"pass: {len(counted)} step(s) passed{extra}"
    bad = [r for r in counted if r.result.status is not Status.PASS]
    return verdict, f"{verdict.value}: " + "; ".join(
        f"{r.step} {r.result.status.value}: {r.result.summary}" for r in bad
    )


def _run_step(step: Step, registry: CheckRegistry, ctx: CheckContext, on_event: EventHook | None) -> StepResult:
    if on_event:
        on_event("start", step.name, step)
    t0 = time.monotonic()
    step_ctx = replace(ctx, timeout_s=step.timeout.total_seconds())
    request = {
        "target": registry.target(step.check),
        "params": to_mapping(step.config),
        "context": step_ctx.to_payload(),
    }
    result = run_in_worker(request, step.timeout.total_seconds())
    out = StepResult(step=step.name, check=step.check, result=result, seconds=time.monotonic() - t0)
    if on_event:
        on_event("finish", step.name, out)
    return out


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(IMPORT_ROOT), env.get("PYTHONPATH", "")) if p)
    # The checks' ranks share this machine's cores and talk over loopback.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def run_in_worker(request: dict[str, Any], timeout_s: float) -> CheckResult:
    """Run one check request in a worker process group; an ERROR result on timeout or a crash."""
    with tempfile.TemporaryDirectory(prefix="megaheal-step-") as tmp:
        result_path = Path(tmp) / "result.json"
        proc = subprocess.Popen(
            [sys.executable, "-m", "runbooks.worker", str(result_path)],
            shell=False,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=_worker_env(),
        )
        try:
            _, err = proc.communicate(json.dumps(request), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            return CheckResult(
                status=Status.ERROR,
                summary=f"timed out after {timeout_s:g}s: stopped (process group {proc.pid} killed)",
                details={"timed_out": True},
            )
        finally:
            # Anything the step left behind in its group (a stray rank) goes with it.
            _kill_group(proc.pid, signal.SIGKILL)
        if result_path.is_file():
            return CheckResult.from_payload(json.loads(result_path.read_text()))
        tail = " | ".join(err.strip().splitlines()[-3:]) if err else ""
        return CheckResult(
            status=Status.ERROR, summary=f"worker exited with code {proc.returncode} without a result: {tail}"
        )


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_group(proc: subprocess.Popen) -> None:
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc.pid, signal.SIGKILL)
    try:
        proc.communicate(timeout=STOP_GRACE_S)  # drain and close the pipes
    except subprocess.TimeoutExpired:
        # Something left the group (setsid) and still holds our pipes; do not wait for it.
        proc.kill()
        proc.wait()
