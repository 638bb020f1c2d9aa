"""The throttled storage writer (checkpoint.throttle_writes_at): a save at a throttled step takes as long as its bytes
at the configured rate, and writes the same checkpoint; other steps are not held."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from train.checkpoint.faults import FailingWriter
from train.checkpoint.manager import CheckpointConfig

pytestmark = pytest.mark.unit


def _save(path: Path, mib_per_s: float) -> float:
    state = {"w": torch.arange(2**18, dtype=torch.float32)}  # 1 MiB
    started = time.monotonic()
    dcp.save(state, checkpoint_id=path, storage_writer=FailingWriter(path, mib_per_s=mib_per_s), no_dist=True)
    took = time.monotonic() - started
    loaded = {"w": torch.zeros(2**18)}
    dcp.load(loaded, checkpoint_id=path, no_dist=True)
    assert torch.equal(loaded["w"], state["w"])
    return took


def test_a_throttled_save_takes_as_long_as_its_bytes_at_the_rate_and_writes_the_same_state(tmp_path: Path) -> None:
    assert _save(tmp_path / "slow", mib_per_s=2.0) >= 0.5  # 1 MiB at 2 MiB/s
    assert _save(tmp_path / "fast", mib_per_s=0.0) < 0.5


def test_the_throttle_rate_must_be_a_positive_number() -> None:
    with pytest.raises(ValueError, match="throttle_mib_per_s must be a finite number > 0, got 0"):
        CheckpointConfig(throttle_writes_at=[4], throttle_mib_per_s=0.0)
