"""`megaheal train`: validates before launching, then runs the job under torchrun (the demo path)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import CONFIGS, REPO, job_env
from train.records import read_records

pytestmark = pytest.mark.multiprocess

MEGAHEAL = [sys.executable, "-c", "from megaheal.cli import app; app()"]


def test_a_bad_layout_is_refused_before_any_rank_starts(tmp_path) -> None:
    proc = subprocess.run(
        [*MEGAHEAL, "train", "--config", str(CONFIGS / "tiny-dp4.yaml"), "--run-dir", str(tmp_path / "run"),
         "--set", "parallel.dp=3"],
        cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "global_batch (8) must be a multiple of parallel.dp (3)" in proc.stderr
    assert not (tmp_path / "run").exists(), "nothing was launched"


@pytest.mark.timeout(300)
def test_demo_job_trains_four_ranks_with_a_falling_loss(tmp_path) -> None:
    run_dir = tmp_path / "demo"
    proc = subprocess.run(
        [*MEGAHEAL, "train", "--config", str(CONFIGS / "demo.yaml"), "--run-dir", str(run_dir), "--set", "steps=12"],
        cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "4 ranks (pp 2 x dp 2 x tp 1)" in proc.stdout
    assert "loss" in proc.stdout and "MFU %" in proc.stdout, "rank 0 prints the per-step table"
    ranks = sorted(int(p.stem) for p in (run_dir / "ranks").glob("*.jsonl"))
    assert ranks == [0, 1, 2, 3]
    losses = [r["loss"] for r in read_records(run_dir / "ranks" / "0.jsonl")]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, f"loss falls on real text: {losses}"
    assert (run_dir / "config.yaml").is_file()
