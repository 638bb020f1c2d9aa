"""Suspect steps re-run on real ranks (train/rerun.py): 4 data-parallel ranks on two "hosts" (n1: ranks 0-1, n2:
ranks 2-3): a replica whose gathered weights went bad named the step it happens (train/param_checksum.py), a poisoned
batch judged data and skipped, then n2's matmuls flipping bits convicted at their first step. One job for all three."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, REPO, job_env
from train.records import read_records

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(240)
def test_a_diverged_replica_a_bad_batch_and_a_host_flipping_bits_are_told_apart_and_no_update_of_theirs_applied(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Step 1: rank 1's gathered copy of one weight has a mantissa bit flipped (its loss shows nothing; only the
    # replicas' checksum sees it). Step 2 trains on samples 16-23, two a replica: sample 18 is replica 1's. From step
    # 3, every forward pass of n2's ranks flips the top exponent bit of one element of a matmul output.
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "-m", "tests.distributed.rank_on_host", "--config", str(CONFIGS / "tiny-dp4.yaml"), "--run-dir",
            str(run_dir), "--set", "steps=6", "--set", "inject_bad_sample=18",
            "--set", "inject_param_flips=[{rank: 1, at_step: 1}]",
            "--set", "inject_matmul_flips=[{node: n2, from_step: 3, rate: 1.0}]"]
    proc = subprocess.run(argv, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=200, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if " re-run (" in line]
    assert len(said) == 3, said
    assert said[0].startswith("step 1 re-run (weights, ") and said[0].endswith("): diverged, ranks [1]; its update "
                                                                               "skipped"), said
    assert said[1].startswith("step 2 re-run (nan, ") and said[1].endswith("): data, samples [18, 20]; its update "
                                                                           "skipped"), said
    assert said[2].startswith("step 3 re-run (") and said[2].endswith(": persistent, ranks [2, 3]; its update skipped")
    records = {r["step"]: r for r in read_records(run_dir / "ranks" / "0.jsonl")}
    assert [records[s].get("rerun") for s in range(6)] == [None, "diverged", "data", "persistent", None, None]
    assert (run_dir / "chaos" / "param-flip-step1-rank1.fired").exists()
    # A skipped step applies nothing (its gradient norm is recorded as 0); the persistent host's later steps are
    # skipped without re-running them, until the healer takes the host out.
    assert [records[s]["grad_norm"] == 0 for s in range(6)] == [False, True, True, True, True, True]
    assert all(r["loss"] == r["loss"] and r["loss"] < 10 for r in records.values())  # finite: no NaN reported
    assert [records[s]["sample_index"] for s in range(6)] == [8, 16, 24, 32, 40, 48]

