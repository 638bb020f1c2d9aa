"""Shared test helpers: running real training jobs (torchrun on gloo, or one process) and reading their records."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from train.records import read_records

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    return env


def run_training(
    run_dir: Path, config: str, overrides: list[str], nproc: int = 1, timeout: float = 240.0
) -> dict[int, list[dict[str, Any]]]:
    """Run a real training job and return each rank's step records.

    nproc > 1 runs it under torchrun (gloo); nproc == 1 as a plain single process.
    """
    args = ["-m", "train", "--config", str(CONFIGS / config), "--run-dir", str(run_dir)]
    for item in overrides:
        args += ["--set", item]
    if nproc > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    else:
        argv = [sys.executable, *args]
    proc = subprocess.run(argv, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"training failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {int(p.stem): read_records(p) for p in sorted((run_dir / "ranks").glob("*.jsonl"))}
