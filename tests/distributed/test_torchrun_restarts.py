"""The trainer under plain torchrun's own restarts (`--max-restarts`), as users run it: a rank SIGKILLed mid-run,
torchrun restarts every worker, and the job resumes from its newest checkpoint and finishes (each restart forms
its process group under a store prefix of its own: the stale keys of the dead round would refuse it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ground import procfs
from tests.conftest import CONFIGS, REPO, job_env, kill_job
from train.records import read_records

pytestmark = pytest.mark.multiprocess
STEPS = 16


@pytest.mark.timeout(300)
def test_a_killed_rank_under_torchrun_max_restarts_is_restarted_and_the_job_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "--max-restarts", "2", "--monitor-interval", "0.2", "-m", "train", "--config",
            str(CONFIGS / "tiny-dp4.yaml"), "--run-dir", str(run_dir), "--resume", "auto",
            "--set", f"steps={STEPS}", "--set", "checkpoint.every_steps=4", "--set", "dist_timeout_s=60"]
    agent = subprocess.Popen(argv, cwd=REPO, env=job_env(), start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        victim = None
        deadline = time.monotonic() + 180
        while victim is None and time.monotonic() < deadline and agent.poll() is None:
            done = read_records(run_dir / "ranks" / "0.jsonl") if (run_dir / "ranks" / "0.jsonl").exists() else []
            if done and done[-1]["step"] >= 6:
                victim = next(p for p in procfs.children(agent.pid) if procfs.worker_rank(p) == 3)
                os.kill(victim, signal.SIGKILL)
            time.sleep(0.1)
        assert victim is not None, "the job never reached step 6"
        out, _ = agent.communicate(timeout=240)
    except BaseException:
        kill_job(agent)
        raise
    assert agent.returncode == 0, out[-4000:]
    records = read_records(run_dir / "ranks" / "0.jsonl")
    pids = {r["pid"] for r in records}
    assert len(pids) == 2, "torchrun started a second round of workers"
    assert {r["step"] for r in records} == set(range(STEPS))
    second = [r for r in records if r["pid"] == records[-1]["pid"]]
    assert second[0]["step"] in (4, 8) and second[-1]["step"] == STEPS - 1  # resumed from a checkpoint, finished
