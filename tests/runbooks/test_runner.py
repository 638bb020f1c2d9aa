"""The runner: steps in their own process groups, stopped at their timeout, parallel batches, verdicts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ground import procfs
from runbooks.registry import CheckContext, default_registry
from runbooks.runner import run_runbook
from runbooks.spec import load_runbook
from tests.conftest import REPO, job_env
from wire.verdict import Status

pytestmark = pytest.mark.services

MEGAHEAL = [sys.executable, "-c", "from megaheal.cli import app; app()"]


def _registry():
    registry = default_registry()
    registry.register("sleeper", "tests.runbooks.checks_for_tests:SleepCheck")
    return registry


def _records(path) -> list[tuple[str, int, int, float]]:
    out = []
    for line in path.read_text().splitlines():
        kind, pid, child, t = line.split()
        out.append((kind, int(pid), int(child), float(t)))
    return out


@pytest.mark.timeout(60)
def test_a_check_past_its_timeout_is_stopped_and_reported_as_error(tmp_path) -> None:
    record = tmp_path / "record.txt"
    path = tmp_path / "slow.yaml"
    path.write_text(f"""name: slow
steps:
  - name: stuck
    check: sleeper
    timeout: 1s
    params: {{sleep: 30s, record: "{record}", with_child: true}}
  - name: after
    check: sleeper
    timeout: 20s
    params: {{sleep: 10ms, record: "{tmp_path / 'after.txt'}"}}
""")
    result = run_runbook(load_runbook(str(path), registry=_registry()), registry=_registry())
    stuck, after = result.steps
    assert stuck.result.status is Status.ERROR
    assert "timed out after 1s" in stuck.result.summary and "stopped" in stuck.result.summary
    [(kind, pid, child, _)] = _records(record)
    assert kind == "start" and child > 0
    assert not procfs.alive(pid) and not procfs.alive(child), "the worker and its child were stopped with the step"
    assert after.result.status is Status.PASS, "later steps still run"
    assert result.verdict is Status.ERROR and result.exit_code == 2
    assert result.summary.startswith("error: stuck error: timed out")


@pytest.mark.timeout(60)
def test_parallel_steps_overlap_and_sequential_ones_do_not(tmp_path) -> None:
    path = tmp_path / "batches.yaml"
    steps = [("a", True), ("b", True), ("c", False)]
    path.write_text(
        "name: batches\nsteps:\n"
        + "".join(
            f"  - name: {name}\n    check: sleeper\n    timeout: 20s\n    parallel: {str(par).lower()}\n"
            f'    params: {{sleep: 300ms, record: "{tmp_path / name}.txt"}}\n'
            for name, par in steps
        )
    )
    result = run_runbook(load_runbook(str(path), registry=_registry()), registry=_registry())
    assert result.verdict is Status.PASS
    span = {}
    for name, _ in steps:
        (_, _, _, start), (_, _, _, end) = _records(tmp_path / f"{name}.txt")
        span[name] = (start, end)
    assert span["a"][0] < span["b"][1] and span["b"][0] < span["a"][1], "a and b ran at the same time"
    assert span["c"][0] >= max(span["a"][1], span["b"][1]), "c started after the parallel batch"


@pytest.mark.timeout(60)
def test_an_unwritable_checkpoint_directory_fails_the_runbook_saying_so(tmp_path) -> None:
    if os.geteuid() != 0:
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        ckpt.chmod(0o555)
    else:
        # Root writes through file modes; sysfs refuses new files to everyone.
        ckpt = "/sys/kernel"
    proc = subprocess.run(
        [
            *MEGAHEAL,
            "diagnose",
            "node-health",
            "--json",
            "--set",
            f"host.checkpoint_dir={ckpt}",
            "--set",
            "host.min_free_gib=0",
            "--baselines",
            str(tmp_path / "baselines.json"),
        ],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=50,
    )
    import json

    out = json.loads(proc.stdout)
    assert proc.returncode == 1, proc.stderr
    assert out["verdict"] == "fail"
    assert f"checkpoint directory {ckpt} is not writable" in out["summary"], out["summary"]
    host = next(s for s in out["steps"] if s["step"] == "host")
    assert host["status"] == "fail"
    assert {"kind": "path", "name": str(ckpt)} == {k: host["suspects"][0][k] for k in ("kind", "name")}


def test_a_runbook_without_any_usable_step_is_an_error_not_a_pass() -> None:
    # On a machine without NVIDIA GPUs both gpu-triage steps skip, which must not read as healthy.
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this machine has an NVIDIA driver: gpu-triage really runs here")
    result = run_runbook(load_runbook("gpu-triage"), CheckContext())
    assert [s.result.status for s in result.steps] == [Status.SKIPPED, Status.SKIPPED]
    assert result.verdict is Status.ERROR and result.exit_code == 2
    assert "no step could test anything" in result.summary and "NVML" in result.summary
