"""Replicas carry their owner's CRC32, and the fault that flips a bit of a held one (train/warm/replicas.py,
train/replica_faults.py): one process, no process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ground.typedconfig import ConfigError
from tests.conftest import REPO
from train.config import load_config
from train.replica_faults import ReplicaFlip, ReplicaFlipper, tensor_data_middle
from train.warm.replicas import Replica, Replicas
from train.warm.snapshot import Snapshot

pytestmark = pytest.mark.unit


def _snapshot(step: int, rank: int = 1) -> Snapshot:
    gen = torch.Generator().manual_seed(step)
    state = {"model": {"emb.weight": torch.randn(64, 32, generator=gen), "norm.weight": torch.ones(32)},
             "optimizer": {"step": step, "exp_avg": [torch.zeros(8)]}, "data_position": step * 8}
    return Snapshot(step=step, rank=rank, layout="tiny", state=state)


def test_a_replica_is_intact_as_sent_and_fails_its_checksum_with_any_one_bit_flipped() -> None:
    replica = Replica.of(_snapshot(4).to_bytes())
    assert replica.intact()
    size = len(replica.payload)
    for at in (0, 1, size // 3, size // 2, size - 1):  # the zip's header, the pickle, the tensor data, the directory
        for bit in (0x01, 0x80):
            flipped = bytearray(replica.payload)
            flipped[at] ^= bit
            assert not Replica(bytes(flipped), replica.crc32).intact(), (at, bit)


def test_the_injected_flip_lands_in_tensor_data_so_the_replica_still_loads_and_only_the_checksum_tells() -> None:
    snap = _snapshot(4)
    payload = bytearray(snap.to_bytes())
    payload[tensor_data_middle(bytes(payload))] ^= 0x10
    loaded = Snapshot.from_bytes(bytes(payload))  # no error from unpickling: silent corruption
    before, after = snap.state["model"]["emb.weight"], loaded.state["model"]["emb.weight"]
    assert (before != after).sum().item() == 1  # the largest tensor, one element off
    assert loaded.state["model"]["norm.weight"].equal(snap.state["model"]["norm.weight"])
    assert not Replica(bytes(payload), Replica.of(snap.to_bytes()).crc32).intact()


def _keeper(rank: int) -> Replicas:
    """Rank `rank` of 4 with stride 2, holding its donor's replicas of steps 4 and 8 as an exchange leaves them."""
    replicas = Replicas(rank, 4, stride=2)
    for step in (4, 8):
        replicas.held[step] = Replica.of(_snapshot(step, replicas.donor).to_bytes())
    return replicas


def test_a_flip_corrupts_its_keepers_first_held_replica_at_or_after_its_step_once_per_run(tmp_path: Path) -> None:
    fault = ReplicaFlip(rank=3, after_step=6)
    keeper = _keeper(3)
    ReplicaFlipper([fault], rank=3, run_dir=tmp_path).maybe(keeper)
    assert keeper.held[4].intact() and not keeper.held[8].intact()
    assert "replica of rank 1 it keeps, step 8" in (tmp_path / "chaos" / fault.mark).read_text()

    # The attempts after it (a new trainer, the same run directory) pass it by; other ranks never had it.
    again = _keeper(3)
    ReplicaFlipper([fault], rank=3, run_dir=tmp_path).maybe(again)
    other = _keeper(1)
    ReplicaFlipper([ReplicaFlip(rank=3, after_step=0)], rank=1, run_dir=tmp_path / "b").maybe(other)
    assert all(r.intact() for r in [*again.held.values(), *other.held.values()])


def test_a_flip_waits_until_its_keeper_holds_a_replica_of_its_step(tmp_path: Path) -> None:
    keeper = _keeper(3)
    flipper = ReplicaFlipper([ReplicaFlip(rank=3, after_step=12)], rank=3, run_dir=tmp_path)
    flipper.maybe(keeper)
    assert all(r.intact() for r in keeper.held.values()) and not (tmp_path / "chaos").exists()
    keeper.held[12] = Replica.of(_snapshot(12, 1).to_bytes())
    flipper.maybe(keeper)
    assert not keeper.held[12].intact()


def test_replica_flips_are_set_by_override_and_a_bad_one_is_refused_naming_its_field_and_value() -> None:
    cfg = load_config(REPO / "configs" / "tiny-dp4.yaml", ["inject_replica_flips=[{rank: 3, after_step: 10}]"])
    assert cfg.inject_replica_flips == [ReplicaFlip(rank=3, after_step=10)]
    with pytest.raises(ConfigError, match=r"inject_replica_flips\[0\]: after_step must be >= 0, got -2"):
        load_config(None, ["inject_replica_flips=[{rank: 1, after_step: -2}]"])
    with pytest.raises(ConfigError, match=r"inject_replica_flips\[1\]: rank must be >= 0, got -1"):
        load_config(None, ["inject_replica_flips=[{rank: 1, after_step: 2}, {rank: -1, after_step: 2}]"])
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'step'"):
        load_config(None, ["inject_replica_flips=[{rank: 1, step: 2}]"])
