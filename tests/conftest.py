"""Shared test helpers: running real training jobs (torchrun on gloo, or one process) and reading their records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ground import procfs
from tests.support import wait_for  # noqa: F401 - the checkpoint tests take it from here
from train.records import read_records

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
TIERS = ("unit", "services", "multiprocess", "e2e", "multihost", "containers")
"""The tiers (pyproject's markers): a test's tier is where it runs (scripts/run-tests.sh), so it must have one."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuse a test without a tier or with two (a module's `pytestmark` and a test's own mark count together)."""
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {', '.join(tiers) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(f"every test needs exactly one tier mark of {', '.join(TIERS)}:\n  "
                                + "\n  ".join(wrong[:20]))


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    return env


def training_argv(run_dir: Path, config: str, overrides: list[str], nproc: int = 1, resume: str | None = None) -> list[str]:
    """The command line of a real training job: torchrun (gloo) for nproc > 1, else a plain process."""
    args = ["-m", "train", "--config", str(CONFIGS / config), "--run-dir", str(run_dir)]
    for item in overrides:
        args += ["--set", item]
    if resume:
        args += ["--resume", resume]
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return [sys.executable, *args]


def start_training(run_dir: Path, config: str, overrides: list[str], nproc: int = 1) -> subprocess.Popen:
    """Start a job in its own session, so a test can signal the launcher and every rank at once."""
    return subprocess.Popen(
        training_argv(run_dir, config, overrides, nproc), cwd=REPO, env=job_env(), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def kill_job(job: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to the launcher and every process it started, at once, then reap the launcher."""
    # NOTE: torchrun starts each rank in a session of its own, so signalling the launcher's process group
    # would not reach the ranks.
    for pid in [job.pid, *procfs.descendants(job.pid)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    job.wait(30)


def run_training(
    run_dir: Path, config: str, overrides: list[str], nproc: int = 1, timeout: float = 240.0,
    resume: str | None = None,
) -> dict[int, list[dict[str, Any]]]:
    """Run a real training job and return each rank's step records.

    nproc > 1 runs it under torchrun (gloo); nproc == 1 as a plain single process.
    """
    argv = training_argv(run_dir, config, overrides, nproc, resume)
    proc = subprocess.run(argv, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"training failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return rank_records(run_dir)


def rank_records(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    return {int(p.stem): read_records(p) for p in sorted((run_dir / "ranks").glob("*.jsonl"))}


@pytest.fixture(scope="session")
def straggler_then_crash(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The self-healing run of tests/selfheal/straggler_crash_run.py, once for every module that checks it."""
    from tests.selfheal.straggler_crash_run import heal

    return heal(tmp_path_factory.mktemp("healed"))
