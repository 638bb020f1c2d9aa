"""A rank that waits for a slow pipeline stage does not count the wait as its own compute (train/timing.py,
TimedPipelineWaits): the demo's job (2 stages x 2 data-parallel ranks, 1F1B) under torchrun, rank 2 (stage 1)
stopped 85% of every 200 ms by SIGSTOP/SIGCONT. Its pipeline partner, rank 0, waits for its activations' gradients;
without the timer that wait was inside rank 0's forward/backward (0.43-0.61 s a step against its stage peer's
0.08 s in a `make demo` here), and the straggler detector named rank 0 and rank 2 in turn."""

from __future__ import annotations

import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import pytest

from healer.runner.chaos import duty_cycle
from tests.conftest import REPO, job_env, rank_records, training_argv

pytestmark = pytest.mark.multiprocess
STEPS, SLOW_RANK, SLOW_FROM = 14, 2, 3


def _first_record(path: Path, deadline: float) -> dict[str, object]:
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if lines and lines[0].endswith("}"):
            return json.loads(lines[0])
        time.sleep(0.05)
    raise TimeoutError(f"no step record in {path}")


@pytest.mark.timeout(300)
def test_the_partner_of_a_slow_stage_waits_in_pp_wait_and_computes_at_its_peers_pace(tmp_path: Path) -> None:
    log = (tmp_path / "job.log").open("w")
    job = subprocess.Popen(training_argv(tmp_path, "demo.yaml", [f"steps={STEPS}", "checkpoint.every_steps=100"],
                                         nproc=4), cwd=REPO, env=job_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        first = _first_record(tmp_path / "ranks" / f"{SLOW_RANK}.jsonl", time.monotonic() + 180)
        slowing = threading.Thread(target=duty_cycle, args=(int(first["pid"]), 0.85, 240.0), daemon=True)
        slowing.start()
        assert job.wait(240) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        job.kill()
        log.close()
    records = rank_records(tmp_path)
    # NOTE: from a few steps on: the slowdown started after rank 2's first record.
    slowed = {r: [x for x in recs if x["step"] >= SLOW_FROM] for r, recs in records.items()}
    assert all(len(v) == STEPS - SLOW_FROM for v in slowed.values())

    def median(rank: int, phase: str) -> float:
        return statistics.median(x["phases"].get(phase, 0.0) for x in slowed[rank])

    compute = {r: median(r, "forward_backward") + median(r, "optimizer") for r in records}
    waits = {r: median(r, "pp_wait") for r in records}
    # Stage 1 (ranks 2, 3): rank 2 computes several times slower than its peer.
    assert compute[2] > 2 * compute[3], compute
    # Stage 0 (ranks 0, 1): rank 0 waits for rank 2 in pp_wait, and computes at rank 1's pace. (Rank 1 waits too,
    # less: for rank 3, which waits for rank 2 in their data-parallel reduce; 0.19 s against rank 0's 0.52 s here.)
    # NOTE: "its pace" within 2x: compute is wall time, and on 2 shared cores rank 0 computes in the bursts when
    # rank 2 runs too. Rank 0 over rank 1: 1.08 alone, 0.93 and 1.24 beside 2 busy loops, 1.34 beside a fresh make
    # test's other worker (which failed a bound of 1.3). With the wait left in its compute it was 5-7x.
    assert compute[0] < 2 * compute[1], (compute, waits)
    assert waits[0] > 3 * compute[0] and waits[0] > 1.5 * waits[1], (compute, waits)
    # What left forward/backward is the wait, no more: none of it is below zero.
    assert all(x["phases"]["forward_backward"] > 0 for recs in records.values() for x in recs)
