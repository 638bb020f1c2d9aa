"""Checkpoints under storage faults and rollbacks (issue 12, finding 9), each with a real training run: a commit
that fails at each of its stages, a disk that is really full, a rollback whose poisoned checkpoints must never be
resumed from again."""

from __future__ import annotations

import json
import math

import pytest

from tests.checkpoint.disks import small_disk
from tests.conftest import rank_records, run_training
from train.checkpoint import catalog

pytestmark = pytest.mark.multiprocess

COMMON = ["optim.lr=1.0e-2", "optim.warmup_steps=2"]


def events(ckpt_dir) -> list[tuple]:
    lines = (ckpt_dir / "events.jsonl").read_text().splitlines()
    return [(e["event"], e["step"], e.get("stage"), e.get("committed")) for e in map(json.loads, lines)]


@pytest.mark.timeout(200)
def test_a_commit_that_fails_at_any_stage_is_reported_and_training_goes_on(tmp_path) -> None:
    ckpt_dir = tmp_path / "checkpoints"
    faults = ["checkpoint.fail_commit_at.manifest=[2]", "checkpoint.fail_commit_at.latest=[3]",
              "checkpoint.fail_commit_at.retention=[4]", "checkpoint.fail_commit_at.events=[5]"]
    records = run_training(tmp_path, "tiny-dp4.yaml", [*COMMON, "parallel.dp=1", "steps=7", "checkpoint.every_steps=1",
                                                       "checkpoint.keep_last=2", *faults])[0]
    assert [r["step"] for r in records] == list(range(7)), "training ran every step"
    assert events(ckpt_dir) == [
        ("checkpoint_saved", 1, None, None),
        ("checkpoint_failed", 2, "manifest", False),
        ("checkpoint_failed", 3, "latest", False),
        ("checkpoint_failed", 4, "retention", True),  # committed: latest names it, older saves stay one round
        # step 5's line is what could not be written: the trainer's own records still tell
        ("checkpoint_saved", 6, None, None),
        ("checkpoint_saved", 7, None, None),
    ]
    told = {e["step"]: e for r in records for e in r["checkpoint_events"]}
    assert (told[5]["event"], told[5]["stage"], told[5]["committed"]) == ("checkpoint_failed", "events", True)
    assert "No space left on device" in told[2]["error"]
    assert catalog.read_latest(ckpt_dir) == "step-00000007"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["events.jsonl", "latest", "step-00000006", "step-00000007"], \
        "failed saves deleted, no temp files left"


# The checkpoint of tiny-dp4 at dp2 (AdamW state): rank 0 writes ~1.96 MB, rank 1 ~2.63 MB, .metadata ~0.2 MB.
SAVE_BYTES = (4_500_000, 5_100_000)
# Room for the kept checkpoint and the next one, with ~1 MiB to spare, but not for a failed save's leftovers too.
DISK_BYTES = 10_700_000


@pytest.mark.timeout(300)
def test_a_failed_save_on_a_full_disk_leaves_nothing_behind_so_the_next_save_fits(tmp_path) -> None:
    with small_disk(tmp_path / "disk", DISK_BYTES) as disk:
        ckpt_dir = disk / "checkpoints"
        # The last rank's write fails (ENOSPC) at step 2, after rank 0 wrote its shard: before the fix that half save
        # stayed, and the real disk was then too full for every later save.
        run_training(tmp_path / "run", "tiny-dp4.yaml", [
            *COMMON, "parallel.dp=2", "steps=5", "checkpoint.every_steps=1", "checkpoint.keep_last=1",
            f"checkpoint.dir={ckpt_dir}", "checkpoint.fail_writes_at=[2]"], nproc=2, timeout=280)
        saved = [e for e in map(json.loads, (ckpt_dir / "events.jsonl").read_text().splitlines())]
        assert SAVE_BYTES[0] < saved[0]["bytes"] < SAVE_BYTES[1], "the disk above is sized for this checkpoint"
        assert [(e["event"], e["step"]) for e in saved] == [
            ("checkpoint_saved", 1), ("checkpoint_failed", 2), ("checkpoint_saved", 3), ("checkpoint_saved", 4),
            ("checkpoint_saved", 5)]
        assert sorted(p.name for p in ckpt_dir.iterdir()) == ["events.jsonl", "latest", "step-00000005"]


@pytest.mark.timeout(300)
def test_after_a_rollback_resume_auto_never_loads_a_checkpoint_of_the_poisoned_attempt(tmp_path) -> None:
    ckpt_dir = tmp_path / "checkpoints"
    one = [*COMMON, "parallel.dp=1"]
    # The attempt with the NaN: step 3's batch poisons the weights; the saves at steps 4 and 6 hold NaN.
    poisoned = run_training(tmp_path, "tiny-dp4.yaml", [*one, "steps=6", "checkpoint.every_steps=2",
                                                        "inject_nan_at_sample=24"])[0]
    assert math.isnan(poisoned[-1]["loss"])
    assert [c.step for c in catalog.list_checkpoints(ckpt_dir)] == [6, 4, 2]
    # The healer's rollback: back to step 2, skipping step 3's batch. This attempt dies before it saves anything.
    run_training(tmp_path, "tiny-dp4.yaml", [*one, "steps=4", "skip_steps=[3]"], resume=str(ckpt_dir / "step-00000002"))
    # The next restart, as after a crash, takes the newest good checkpoint: step 2, not the poisoned step 6.
    run_training(tmp_path, "tiny-dp4.yaml", [*one, "steps=5", "skip_steps=[3]"], resume="auto")
    resumed = rank_records(tmp_path)[0][len(poisoned) + 2:]
    assert [r["step"] for r in resumed] == [2, 3, 4], "resumed at step 2"
    assert all(math.isfinite(r["loss"]) for r in resumed)
    assert [c.status for c in catalog.list_checkpoints(ckpt_dir)] == ["abandoned", "abandoned", "ok"]
    assert catalog.read_latest(ckpt_dir) == "step-00000002", "latest names where training went back to"
