"""Warm restarts on real processes (train/warm/): a pool of 4 rank workers and a standby on gloo, a rank SIGKILLed
mid-run. The survivors keep their processes, the standby takes the dead rank's place with its state from a peer's
memory, and the losses go on exactly as in a run that was never interrupted."""

from __future__ import annotations

import json
import re
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CONFIGS, job_env, rank_records, run_training
from train.warm.pool import WarmPool

pytestmark = pytest.mark.multiprocess
STEPS = 14
COMMON = ["optim.lr=1.0e-2", "optim.warmup_steps=2", f"steps={STEPS}", "peak_flops=1e12"]


def _losses(run_dir: Path) -> dict[int, float]:
    """Rank 0's loss per step, the last record of each step winning (steps redone after a restart overwrite)."""
    return {r["step"]: r["loss"] for r in rank_records(run_dir)[0]}


def _step_of_rank0(run_dir: Path) -> int:
    path = run_dir / "ranks" / "0.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(x)["step"] for x in lines if x.strip()), default=-1)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("straight")
    run_training(run_dir, "tiny-dp4.yaml", COMMON, nproc=4)
    return _losses(run_dir)


def _pool(run_dir: Path, *extra: str) -> WarmPool:
    env = {k: v for k, v in job_env().items() if k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "PYTHONUNBUFFERED")}
    pool = WarmPool(str(CONFIGS / "tiny-dp4.yaml"), run_dir, world=4, overrides=[*COMMON, *extra], standbys=1,
                    env=env, timeout_s=30)
    pool.start()
    return pool


def _kill_at(step: int, rank: int, fired: dict[str, Any], when: Any = None) -> Any:
    def hook(pool: WarmPool) -> None:
        if "pid" not in fired and (when is None or when(pool)) and _step_of_rank0(pool.run_dir) >= step:
            fired["before"] = pool.pids()
            fired["pid"] = pool.kill_rank(rank, signal.SIGKILL)
    return hook


@pytest.mark.timeout(240)
def test_a_killed_rank_is_replaced_warm_by_a_standby_with_its_state_from_a_peer_and_the_losses_go_on_unchanged(
        tmp_path: Path, straight: dict[int, float]) -> None:
    # No disk checkpoint at all (every_steps 0): snapshots every 2 steps in memory are the only state to resume from.
    pool = _pool(tmp_path, "checkpoint.every_steps=0", "snapshot_every_steps=2")
    try:
        fired: dict[str, Any] = {}
        standby = pool.standby_workers()[0]
        standby_pid = pool.procs[standby].pid
        assert pool.run(timedelta(seconds=200), on_poll=_kill_at(5, 2, fired)) == "finished"
    finally:
        pool.close()
    (restart,) = pool.restarts
    assert restart.kind == "warm" and "rank 2" in restart.why and restart.ready_at is not None
    after = pool.pids()
    # The survivors are the same processes; the dead rank's place went to the standby that was already up.
    assert {r: after[r] for r in (0, 1, 3)} == {r: fired["before"][r] for r in (0, 1, 3)}
    assert after[2] == standby_pid != fired["pid"]
    # Each worker reports "<source> in <seconds> s": every rank resumed from the same step in memory.
    (source,) = {s.split(" in ")[0] for s in restart.sources.values()}
    assert source.startswith("memory step ")
    step = int(source.split()[2])
    assert step >= 4 and step % 2 == 0
    assert not any((tmp_path / "checkpoints").iterdir())  # nothing on disk it could have read
    losses = _losses(tmp_path)
    assert sorted(losses) == list(range(STEPS))
    assert losses == pytest.approx(straight, rel=1e-6)


@pytest.mark.timeout(240)
def test_a_second_crash_during_a_warm_restart_falls_back_to_a_cold_start_from_disk_and_still_finishes(
        tmp_path: Path, straight: dict[int, float]) -> None:
    pool = _pool(tmp_path, "checkpoint.every_steps=4", "snapshot_every_steps=2")
    try:
        first: dict[str, Any] = {}
        second: dict[str, Any] = {}
        during = _kill_at(0, 1, second, when=lambda p: len(p.restarts) == 1 and p.restarts[0].ready_at is None)

        def hook(p: WarmPool) -> None:
            _kill_at(5, 2, first)(p)
            during(p)

        assert pool.run(timedelta(seconds=200), on_poll=hook) == "finished"
    finally:
        pool.close()
    assert [r.kind for r in pool.restarts] == ["warm", "cold"]
    cold = pool.restarts[1]
    assert {s.split(" in ")[0] for s in cold.sources.values()} == {"disk"}
    # Every worker of the cold generation is new.
    assert not set(pool.pids().values()) & set(first["before"].values())
    losses = _losses(tmp_path)
    assert sorted(losses) == list(range(STEPS)) and losses == pytest.approx(straight, rel=1e-6)


@pytest.mark.timeout(240)
def test_a_rollback_in_memory_marks_the_disks_newer_checkpoints_abandoned_so_no_cold_resume_goes_back_to_them(
        tmp_path: Path) -> None:
    # A rollback past a bad batch throws away what was trained after the state it goes back to. Should the warm pool
    # fail after it (a rank that cannot leave the aborted generation), a cold `--resume auto` must not pick the
    # checkpoints of that history (a NaN's poisoned weights) off the disk.
    # A save every step, a state in memory every 4 (each rank keeps its last two: 4 and 8 when it goes back).
    pool = _pool(tmp_path, "checkpoint.every_steps=1", "checkpoint.keep_last=20", "snapshot_every_steps=4")
    rolled: dict[str, int] = {}

    def hook(p: WarmPool) -> None:
        if not rolled and _step_of_rank0(p.run_dir) >= 9:
            rolled["at"] = _step_of_rank0(p.run_dir)
            p.rollback(5, "test: a bad batch at step 6")

    try:
        assert pool.run(timedelta(seconds=200), on_poll=hook) == "finished"
    finally:
        pool.close()
    (restart,) = pool.restarts
    (source,) = {s.split(" in ")[0] for s in restart.sources.values()}
    back_to = int(source.split()[2])
    assert restart.kind == "rollback" and back_to == 4
    said = "".join(path.read_text(errors="replace") for path in pool.log_dir.glob("*.log"))
    abandoned = sorted(int(m) for m in re.findall(r"step-0*(\d+) abandoned: training goes back to a state held in memory",
                                                    said))
    # Every checkpoint saved after the state it went back to, up to where it was (9 at least: rank 0 was there).
    assert abandoned == list(range(back_to + 1, abandoned[-1] + 1)) and abandoned[-1] >= rolled["at"], said[-3000:]
