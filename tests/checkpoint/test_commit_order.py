"""A checkpoint never stands before the record of the last step it holds (one process, no process group)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from train.checkpoint import catalog
from train.checkpoint.state import capture
from train.config import load_config
from train.records import read_records
from train.trainer import Trainer

pytestmark = pytest.mark.unit

TINY = ["steps=8", "peak_flops=1e12", "parallel.dp=1", "checkpoint.every_steps=2"]


def _latest_at_each_record(trainer: Trainer) -> dict[int, str | None]:
    """Wrap the trainer's record writer: which checkpoint `latest` named as each step's record was written."""
    seen: dict[int, str | None] = {}
    write = trainer.writer.write

    def spy(record: dict[str, Any]) -> None:
        seen[record["step"]] = catalog.read_latest(trainer.checkpointer.dir)
        write(record)

    trainer.writer.write = spy  # type: ignore[method-assign]
    return seen


def test_a_stops_checkpoint_is_committed_only_after_the_record_of_its_last_step(tmp_path: Path) -> None:
    # Before the fix the stop's save was committed inside the step and its record written after it: a stop's short
    # grace that ran out in between left a checkpoint of 4 steps and no record of step 3 (a gap in the loss curve).
    trainer = Trainer(load_config(REPO / "configs" / "tiny-dp4.yaml", TINY), tmp_path)
    seen = _latest_at_each_record(trainer)
    for _ in range(3):
        trainer.step()
    trainer.request_stop()
    trainer.run()  # step 3, the stop's save of 4 steps, and the exit

    assert seen[3] in (None, catalog.step_dir_name(2)), "no checkpoint of 4 steps before step 3's record"
    assert catalog.read_latest(trainer.checkpointer.dir) == catalog.step_dir_name(4), "the stop's save counts"
    assert [r["step"] for r in read_records(tmp_path / "ranks" / "0.jsonl")] == [0, 1, 2, 3]


def test_a_periodic_save_commits_after_the_record_of_the_step_that_started_it(tmp_path: Path) -> None:
    trainer = Trainer(load_config(REPO / "configs" / "tiny-dp4.yaml", TINY), tmp_path)
    seen = _latest_at_each_record(trainer)
    trainer.run()
    for step, latest in seen.items():
        assert latest is None or latest <= catalog.step_dir_name(step), f"step {step}'s record came after {latest}"
    assert catalog.read_latest(trainer.checkpointer.dir) == catalog.step_dir_name(8)
    saved = [e["step"] for r in read_records(tmp_path / "ranks" / "0.jsonl") for e in r["checkpoint_events"]]
    assert saved == [2, 4, 6], "each save's event reaches a later record (the final one's is in events.jsonl)"


def test_a_save_left_unreleased_by_a_failed_step_still_commits_and_ends_its_thread_at_close(tmp_path: Path) -> None:
    # A step that raises between its save and its record never releases the save: close() must, or the finalizer
    # thread stays parked and the interpreter, which joins it at exit, never exits.
    trainer = Trainer(load_config(REPO / "configs" / "tiny-dp4.yaml", TINY), tmp_path)
    state = capture(trainer.parts, trainer.optimizer, trainer.lr_scheduler, 1, trainer.loader.position, 0)
    trainer.checkpointer.save(state, 1, trainer.loader.position)
    time.sleep(0.5)  # the write is long done (single process, ~2 MB); the commit waits for its release
    assert catalog.read_latest(trainer.checkpointer.dir) is None
    trainer.close(abandon=True)  # as run() closes after an exception: no waiting for the save
    deadline = time.monotonic() + 30
    while any(t.name.startswith("ckpt-finalize") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ckpt-finalize")]
    assert catalog.read_latest(trainer.checkpointer.dir) == catalog.step_dir_name(1), "a written save still counts"
