"""A corrupted replica on real processes (train/warm/): a pool of 4 rank workers, 2 per "host" (so each rank's
replica lives on the other host) and standbys, on gloo. Rank 1 is SIGKILLed twice: first with its keeper's replica
intact (the standby resumes from it, in memory), then after the injected fault flipped one bit of the replica its
keeper, rank 3, holds: the replica fails its checksum, and every rank resumes from the disk checkpoint and says why."""

from __future__ import annotations

import json
import signal
from datetime import timedelta
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, job_env
from train.replica_faults import ReplicaFlip
from train.warm.pool import WarmPool

pytestmark = pytest.mark.multiprocess
STEPS = 16
EVERY = 4
"""Snapshots every 4 steps (4, 8, 12): the kills land a few steps away from the next one."""
FLIP = ReplicaFlip(rank=3, after_step=8)
"""Rank 3 keeps rank 1's replicas (stride 2 in a world of 4)."""
OVERRIDES = ["optim.lr=1.0e-2", "optim.warmup_steps=2", f"steps={STEPS}", "peak_flops=1e12",
             "checkpoint.every_steps=2", f"snapshot_every_steps={EVERY}",
             f"inject_replica_flips=[{{rank: {FLIP.rank}, after_step: {FLIP.after_step}}}]"]


def _step_of_rank0(run_dir: Path) -> int:
    path = run_dir / "ranks" / "0.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(x)["step"] for x in lines if x.strip()), default=-1)


class Kills:
    """Rank 1 killed once the first snapshot is everywhere (before the flip), then again as soon as the flip fired."""

    def __init__(self) -> None:
        self.flipped_before_first: bool | None = None
        self.second_at: int | None = None

    def __call__(self, pool: WarmPool) -> None:
        mark = pool.run_dir / "chaos" / FLIP.mark
        if self.flipped_before_first is None and not pool.restarts and _step_of_rank0(pool.run_dir) >= EVERY:
            self.flipped_before_first = mark.exists()
            pool.kill_rank(1, signal.SIGKILL)
        elif (self.second_at is None and len(pool.restarts) == 1 and pool.restarts[0].ready_at is not None
              and mark.exists()):
            self.second_at = _step_of_rank0(pool.run_dir)
            pool.kill_rank(1, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_a_replica_that_fails_its_checksum_makes_every_rank_resume_from_disk_and_say_why(tmp_path: Path) -> None:
    env = {k: v for k, v in job_env().items() if k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "PYTHONUNBUFFERED")}
    pool = WarmPool(str(CONFIGS / "tiny-dp4.yaml"), tmp_path, world=4, overrides=OVERRIDES, standbys=2, per_host=2,
                    env=env, timeout_s=30)
    kills = Kills()
    pool.start()
    try:
        assert pool.run(timedelta(seconds=150), on_poll=kills) == "finished"
    finally:
        pool.close()
    assert kills.flipped_before_first is False, "the first kill came after the flip: no intact replica to resume from"
    first, second = pool.restarts
    sources: list[set[str]] = [{s.split(" in ")[0] for s in r.sources.values()} for r in (first, second)]
    assert [r.kind for r in (first, second)] == ["warm", "warm"] and "rank 1" in first.why and "rank 1" in second.why
    # Intact: the standby took rank 1's state from rank 3 (the other "host"), as every rank resumed from memory.
    (intact,) = sources[0]
    assert intact.startswith("memory step ") and int(intact.split()[2]) == EVERY
    # Flipped: every rank (the one handed the replica and its peers alike) fell back to the disk, saying why.
    assert sources[1] == {"disk (replica of rank 1 kept by rank 3 failed its checksum at step 8)"}, \
        f"{sources[1]} (second kill at rank 0's step {kills.second_at})"
    said = "".join(path.read_text(errors="replace") for path in pool.log_dir.glob("*.log"))
    assert "fault injection: rank 3 flipped bit" in said and "replica of rank 1 it keeps, step 8" in said
    # The disk resume went on to the end: every step recorded by rank 0.
    records = [json.loads(x) for x in (tmp_path / "ranks" / "0.jsonl").read_text().splitlines() if x.strip()]
    assert sorted({r["step"] for r in records}) == list(range(STEPS))
