"""In-memory snapshots and where a warm restart resumes from (train/warm/): one process, no process group."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from train.checkpoint.state import capture
from train.config import load_config
from train.trainer import Trainer
from train.warm.replicas import common_step, keeper_of, replica_stride
from train.warm.snapshot import Snapshot, SnapshotMismatch

pytestmark = pytest.mark.unit

TINY = ["steps=6", "peak_flops=1e12", "checkpoint.every_steps=0", "parallel.dp=1", "optim.lr=1e-2"]


def _trainer(tmp_path: Path, *extra: str, snapshot: Snapshot | None = None) -> Trainer:
    cfg = load_config(REPO / "configs" / "tiny-dp4.yaml", [*TINY, *extra])
    return Trainer(cfg, tmp_path, snapshot=snapshot)


def test_a_trainer_resumed_from_a_snapshot_takes_the_same_steps_as_the_one_it_was_taken_from(tmp_path: Path) -> None:
    first = _trainer(tmp_path / "a")
    for _ in range(3):
        first.step()
    state = capture(first.parts, first.optimizer, first.lr_scheduler, 3, first.loader.position, 0)
    snap = Snapshot.from_bytes(Snapshot.take(state, 3, 0, first.layout).to_bytes())  # as a peer would get it
    straight = [first.step().loss for _ in range(3)]
    first.close()

    resumed = _trainer(tmp_path / "b", snapshot=snap)
    # At step 3 in a run directory without a checkpoint: the state came from memory.
    assert resumed.step_index == 3 and not any((tmp_path / "b" / "checkpoints").iterdir())
    again = [resumed.step().loss for _ in range(3)]
    resumed.close()
    assert again == straight  # bit for bit: weights, optimizer moments, lr schedule, data position and RNG


def test_a_snapshot_is_a_copy_that_later_steps_do_not_change(tmp_path: Path) -> None:
    t = _trainer(tmp_path)
    t.step()
    state = capture(t.parts, t.optimizer, t.lr_scheduler, 1, t.loader.position, 0)
    snap = Snapshot.take(state, 1, 0, t.layout)
    name = next(k for k in snap.state["model"] if k.endswith("weight"))
    before = snap.state["model"][name].clone()
    t.step()
    t.close()
    assert snap.state["model"][name].equal(before)


def test_a_snapshot_of_another_layout_or_rank_is_refused_by_name(tmp_path: Path) -> None:
    t = _trainer(tmp_path)
    state = capture(t.parts, t.optimizer, t.lr_scheduler, 0, 0, 0)
    snap = Snapshot.take(state, 0, 0, "another-layout")
    with pytest.raises(SnapshotMismatch, match="config another-layout"):
        snap.fill(state, 0, t.layout)
    with pytest.raises(SnapshotMismatch, match="snapshot of rank 3"):
        Snapshot.take(state, 0, 3, t.layout).fill(state, 0, t.layout)
    shrunk = Snapshot.take(state, 0, 0, t.layout)
    name = next(iter(shrunk.state["model"]))
    shrunk.state["model"][name] = shrunk.state["model"][name][:1]
    with pytest.raises(SnapshotMismatch, match=f"state.model.{name}: shape"):
        shrunk.fill(capture(t.parts, t.optimizer, t.lr_scheduler, 0, 0, 0), 0, t.layout)
    t.close()


def test_replicas_live_on_the_next_host_when_the_job_spans_hosts_else_on_the_next_rank() -> None:
    assert replica_stride(world=8, per_host=4) == 4 and [keeper_of(r, 8, 4) for r in (0, 5)] == [4, 1]
    assert replica_stride(world=4, per_host=4) == 1 and keeper_of(3, 4, 1) == 0


def test_the_resume_step_is_the_newest_every_rank_has_itself_or_through_its_keeper() -> None:
    # Rank 2 is new (it holds nothing); its keeper, rank 3, holds rank 2's replicas of steps 8 and 12.
    own = [[8, 12], [8, 12], [], [8, 12]]
    held = [[8, 12], [8, 12], [8, 12], [8, 12]]
    assert common_step(own, held, stride=1) == 12
    # A crash in the middle of the step-12 exchange: rank 3 got only the step-8 replica of rank 2.
    assert common_step(own, [[8, 12], [8, 12], [8, 12], [8]], stride=1) == 8
    # A rollback to before step 10.
    assert common_step(own, held, stride=1, at_most=10) == 8
    # Rank 2 and its keeper both lost: nothing in memory can bring rank 2 back.
    assert common_step([[8, 12], [8, 12], [], []], [[8, 12], [8, 12], [], []], stride=1) is None
