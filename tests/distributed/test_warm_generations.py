"""Many warm restarts in one job (train/warm/): a pool of 4 ranks and 2 standbys on gloo goes through more than 20
generations, crash replacements (a rank SIGKILLed, a standby takes it) and rollbacks (every rank back to a state it
holds in memory) mixed, some rollbacks landing while the generation before is still forming its process group.
Every generation must form (a rank that cannot leave an aborted one ends itself and the pool restarts cold), and the
losses must be those of a run that was never interrupted.

On the code before this test (9a2dd84) a worker whose group formation was aborted kept torch's group counter at 1
and named its next group "1" while its peers named theirs "0": every rank then waited in the rendezvous until the
collective timeout (the hang that failed `make demo` after a warm rollback)."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, job_env, rank_records, run_training
from train.warm.pool import WarmPool
from train.warm.worker import STUCK_EXIT_CODE
from wire.warm_plan import key

pytestmark = pytest.mark.multiprocess
STEPS = 60
"""Room for the faults: each comes two of rank 0's records after the one before and none waits for a standby, so the
22 are done by step 44 even if no fault cost a step (with 36 steps a CI run ended 17 faults in, the test waiting
for standbys to import while the job trained on)."""
COMMON = ["optim.lr=1.0e-2", "optim.warmup_steps=2", f"steps={STEPS}", "peak_flops=1e12"]
KINDS = ("kill", "rollback", "kill", "kill-then-rollback")
"""The faults in turn; a kill-then-rollback rolls back while the kill's replacement generation forms."""
FORMING_DELAYS_S = (0.0, 0.15, 0.4, 0.9)
"""How long after the replacement generation was planned its rollback comes: into the plan's read, the rendezvous,
the trainer's build, the resume."""
FAULTS = 22


def _last_step(run_dir: Path) -> tuple[int, int]:
    """Rank 0's records so far, and the step of its newest (-1: none yet)."""
    path = run_dir / "ranks" / "0.jsonl"
    lines = [x for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return len(lines), json.loads(lines[-1])["step"] if lines else -1


@dataclass
class Faults:
    """Plays FAULTS faults, each once the running generation is ready and rank 0 has recorded two steps in it."""

    done: int = 0
    records_at_last: int = 0
    pending_rollback: tuple[int, float] | None = None
    """(generation planned for the kill, when it was seen) of a kill whose rollback is still to come."""
    log: list[str] = field(default_factory=list)

    def __call__(self, pool: WarmPool) -> None:
        if self.pending_rollback is not None:
            self._rollback_while_forming(pool)
            return
        if self.done >= FAULTS or not pool.ready() or pool.generation < len(pool.restarts):
            return
        records, step = _last_step(pool.run_dir)
        if records < self.records_at_last + 2 or step < 1:
            return
        kind, rank = KINDS[self.done % len(KINDS)], self.done % 4
        if kind != "rollback" and not any(pool.store is not None and pool.store.check([key("hello", w)])
                                          for w in pool.standby_workers()):
            # NOTE: no standby is up to replace a rank (the one started after the last warm restart still imports):
            # a rollback now, not a wait. While the test waited, the job trained on (~10 steps under CI's load) and
            # could end before every fault had fired.
            kind = "rollback (no standby up)"
        if kind.startswith("rollback"):
            pool.rollback(step - 1, f"fault {self.done}: rollback at step {step}")
        else:
            pool.kill_rank(rank, signal.SIGKILL)
            if kind == "kill-then-rollback":
                self.pending_rollback = (pool.generation + 1, 0.0)
        self.log.append(f"{kind} rank {rank} at step {step} (generation {pool.generation})")
        self.done += 1
        self.records_at_last = records

    def _rollback_while_forming(self, pool: WarmPool) -> None:
        assert self.pending_rollback is not None
        generation, seen = self.pending_rollback
        if pool.generation < generation:
            return  # the pool has not planned the replacement yet
        now = time.monotonic()
        if not seen:
            self.pending_rollback = (generation, now)
            return
        if now - seen < FORMING_DELAYS_S[(self.done // len(KINDS)) % len(FORMING_DELAYS_S)]:
            return
        _, step = _last_step(pool.run_dir)
        pool.rollback(max(step - 1, 0), f"rollback while generation {generation} forms")
        self.log.append(f"rollback while generation {generation} forms ({now - seen:.2f} s after its plan)")
        self.pending_rollback = None


@pytest.mark.timeout(600)
def test_one_job_goes_through_more_than_twenty_warm_generations_and_trains_as_if_never_interrupted(
        tmp_path: Path) -> None:
    straight_dir = tmp_path / "straight"
    run_training(straight_dir, "tiny-dp4.yaml", COMMON, nproc=4)
    straight = {r["step"]: r["loss"] for r in rank_records(straight_dir)[0]}

    healed = tmp_path / "warm"
    env = {k: v for k, v in job_env().items() if k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "PYTHONUNBUFFERED")}
    pool = WarmPool(str(CONFIGS / "tiny-dp4.yaml"), healed, world=4, standbys=2, env=env, timeout_s=30,
                    max_restarts=100, overrides=[*COMMON, "checkpoint.every_steps=4", "snapshot_every_steps=1"])
    faults = Faults()
    pool.start()
    try:
        outcome = pool.run(timedelta(seconds=540), on_poll=faults)
    finally:
        pool.close()
    kinds = [r.kind for r in pool.restarts]
    assert outcome == "finished", f"{outcome}; faults: {faults.log}; restarts: {pool.report()}"
    assert faults.done == FAULTS and pool.generation >= 20, faults.log
    assert kinds.count("warm") + kinds.count("rollback") >= 20, kinds
    # Crash replacements, not only rollbacks: the first two kills find the pool's two standbys up; later ones find
    # the standby started after a warm restart (7 of 22 faults were kills here with both cores loaded).
    assert kinds.count("warm") >= 3, kinds
    # A restart is cold only where a rank could not leave an aborted generation and ended itself, or where the last
    # fault came after the last step and a peer had finished (CI once): every other generation formed. NOTE: the
    # first is the backstop. Before inprocess/waits.py a rank held in a gloo all-gather whose transfer gloo never woke
    # ended itself in 3 of 11 runs here; none did in 8 runs since (2 ranks whose waits it ended left at once).
    cold_because = (f"exited {STUCK_EXIT_CODE}", "finished")
    assert all(any(c in r.why for c in cold_because) for r in pool.restarts if r.kind == "cold"), pool.report()
    assert all(r.ready_at is not None for r in pool.restarts[-1:])
    losses = {r["step"]: r["loss"] for r in rank_records(healed)[0]}
    assert sorted(losses) == list(range(STEPS))
    assert losses == pytest.approx(straight, rel=1e-6)


@pytest.mark.timeout(300)
def test_a_rank_lost_after_the_last_step_leaves_a_job_that_still_finishes(tmp_path: Path) -> None:
    """Rank 0 is killed once it has recorded the job's last step, in its final save: its peers finish and exit 0
    before or while the pool plans the replacement. The job must still end (from the disk, as no generation can
    form with ranks that are gone) with every step's loss as first trained. Before the fix the replacement waited in
    the rendezvous for peers that had finished, and the pool waited for ever."""
    steps = 8
    pool = WarmPool(str(CONFIGS / "tiny-dp4.yaml"), tmp_path, world=4, standbys=1, timeout_s=30, max_restarts=4,
                    env={k: v for k, v in job_env().items() if k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")},
                    overrides=[*COMMON, f"steps={steps}", "checkpoint.every_steps=4", "snapshot_every_steps=1"])
    killed: list[int] = []

    def kill_after_the_last_step(pool: WarmPool) -> None:
        if not killed and pool.generation == 0 and _last_step(tmp_path)[1] == steps - 1:
            killed.append(pool.kill_rank(0, signal.SIGKILL))

    pool.start()
    try:
        outcome = pool.run(timedelta(seconds=240), on_poll=kill_after_the_last_step)
    finally:
        pool.close()
    assert killed, "rank 0 was never seen at the last step"
    assert outcome == "finished", f"{outcome}: {pool.report()}"
    if pool.restarts:  # none where rank 0 had exited (0) before the signal reached it
        # Its peers gone before the pool saw the kill: one cold restart; gone after it planned the replacement: that
        # warm generation, then a cold one once a peer is seen finished.
        assert "rank 0 (w0) exited -9" in pool.restarts[0].why, pool.report()
        assert pool.restarts[-1].kind == "cold" and len(pool.restarts) <= 2, pool.report()
    by_step: dict[int, set[float]] = {}
    for record in rank_records(tmp_path)[0]:
        by_step.setdefault(record["step"], set()).add(round(record["loss"], 6))
    assert sorted(by_step) == list(range(steps))
    assert all(len(losses) == 1 for losses in by_step.values()), by_step
