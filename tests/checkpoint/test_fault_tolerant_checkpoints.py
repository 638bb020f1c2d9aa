"""Checkpoints under real faults: SIGKILL of every rank, a truncated shard, a smaller dp degree,
SIGTERM preemption, a failing storage writer. Every case runs real training processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, kill_job, rank_records, run_training, start_training, wait_for
from train.checkpoint import catalog

pytestmark = pytest.mark.multiprocess

# A higher learning rate than the config's, so that a wrong optimizer or data position shows in the loss.
COMMON = ["optim.lr=1.0e-2", "optim.warmup_steps=2"]


def _by_step(records: list[dict]) -> dict[int, dict]:
    """The last record written for each step (a resumed run appends after the killed run's lines)."""
    return {r["step"]: r for r in records}


def _latest(run_dir) -> str | None:
    return catalog.read_latest(run_dir / "checkpoints")


# The uninterrupted dp4 run the resumed runs are compared with, once for the module: a save every step (saves do not
# change what is trained), each kept, so that any step's checkpoint is there to resume from.
STRAIGHT = [*COMMON, "steps=8", "checkpoint.every_steps=1", "checkpoint.keep_last=8"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, dict], object]:
    """(the last record of each step of rank 0, the run directory)."""
    run_dir = tmp_path_factory.mktemp("straight")
    return _by_step(run_training(run_dir, "tiny-dp4.yaml", STRAIGHT, nproc=4)[0]), run_dir


@pytest.mark.timeout(400)
def test_resume_after_sigkill_of_every_rank_gives_the_same_losses_as_an_uninterrupted_run(straight, tmp_path) -> None:
    overrides = [*COMMON, "steps=8", "checkpoint.every_steps=4"]
    straight, _ = straight

    run_dir = tmp_path / "killed"
    job = start_training(run_dir, "tiny-dp4.yaml", overrides, nproc=4)
    try:
        wait_for("the step-4 checkpoint to commit", lambda: _latest(run_dir) == "step-00000004", 200)
    finally:
        kill_job(job)  # the launcher and every rank, no chance to clean up
    resumed = run_training(run_dir, "tiny-dp4.yaml", overrides, nproc=4, resume="auto")
    steps = _by_step(resumed[0])
    assert sorted(steps) == list(range(8))
    for step in range(4, 8):
        assert steps[step]["loss"] == pytest.approx(straight[step]["loss"], rel=1e-5), f"step {step}"
        assert steps[step]["sample_index"] == straight[step]["sample_index"]
    assert steps[7]["loss"] < steps[0]["loss"]


@pytest.mark.timeout(200)
def test_a_truncated_shard_in_the_newest_checkpoint_falls_back_to_the_previous_one(tmp_path) -> None:
    overrides = [*COMMON, "steps=4", "checkpoint.every_steps=2"]
    run_training(tmp_path, "tiny-dp4.yaml", [*overrides, "parallel.dp=1"])
    shard = tmp_path / "checkpoints" / "step-00000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    verify = subprocess.run([sys.executable, "-c", "from megaheal.cli import app; app()", "ckpt", "verify",
                             str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert verify.returncode == 1 and "step-00000004: __0_0.distcp: size" in verify.stderr

    proc = subprocess.run(
        [sys.executable, "-m", "train", "--config", str(REPO / "configs" / "tiny-dp4.yaml"), "--run-dir",
         str(tmp_path), "--resume", "auto", *sum((["--set", o] for o in [*overrides, "parallel.dp=1", "steps=6"]), [])],
        cwd=REPO, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping" in proc.stdout and "step-00000004: __0_0.distcp: size" in proc.stdout
    assert "loading" in proc.stdout and "step-00000002 (step 2)" in proc.stdout
    records = rank_records(tmp_path)[0]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 2, 3, 4, 5], "resumed at step 2"


@pytest.mark.timeout(400)
def test_a_dp4_checkpoint_resumes_at_dp2_and_in_one_process_with_the_same_model(straight, tmp_path) -> None:
    # The same run as the straight one (its step count sets the lr schedule), no saves of its own.
    overrides = [*COMMON, "steps=8", "checkpoint.every_steps=0"]
    straight, straight_dir = straight
    saved = straight_dir / "checkpoints" / "step-00000003"

    for name, layout, nproc in (("dp2", ["parallel.dp=2"], 2), ("dp1", ["parallel.dp=1"], 1)):
        records = run_training(tmp_path / name, "tiny-dp4.yaml", [*overrides, *layout], nproc=nproc,
                               resume=str(saved))
        steps = _by_step(records[0])
        assert sorted(steps) == list(range(3, 8)), f"{name} resumed at step 3"
        # Step 3's loss is computed by the loaded parameters before any update: equal parameters; the steps after
        # it, equal optimizer state, lr schedule and data position too.
        for step in range(3, 8):
            assert steps[step]["loss"] == pytest.approx(straight[step]["loss"], rel=1e-5), f"{name} step {step}"
            assert steps[step]["sample_index"] == straight[step]["sample_index"]


@pytest.mark.timeout(300)
def test_sigterm_writes_a_final_checkpoint_and_exits_cleanly(tmp_path) -> None:
    job = start_training(tmp_path, "tiny-dp4.yaml", [*COMMON, "steps=500"], nproc=4)
    try:
        records = wait_for("two steps", lambda: (tmp_path / "ranks" / "3.jsonl").exists() and rank_records(tmp_path)
                           if len(rank_records(tmp_path).get(0, [])) >= 2 else None, 200)
        for recs in records.values():  # preemption signals every process of the job
            os.kill(recs[0]["pid"], signal.SIGTERM)
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            kill_job(job)
    assert job.returncode == 0, out[-3000:]
    last_step = rank_records(tmp_path)[0][-1]["step"]
    assert last_step < 499
    assert _latest(tmp_path) == catalog.step_dir_name(last_step + 1)
    info = catalog.list_checkpoints(tmp_path / "checkpoints")[0]
    assert info.complete and catalog.verify(info, checksums=True) == []
    assert "stopped on request" in out


@pytest.mark.timeout(300)
def test_a_failing_storage_writer_is_reported_and_training_goes_on_with_latest_unchanged(tmp_path) -> None:
    overrides = [*COMMON, "steps=6", "checkpoint.every_steps=2", "checkpoint.fail_writes_at=[6]"]
    records = run_training(tmp_path, "tiny-dp4.yaml", overrides, nproc=4)
    assert [r["step"] for r in records[0]] == list(range(6)), "training ran every step"
    assert _latest(tmp_path) == "step-00000004", "latest still names the previous good checkpoint"
    assert not (tmp_path / "checkpoints" / "step-00000006" / "manifest.json").exists()
    events = [json.loads(line) for line in (tmp_path / "checkpoints" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events] == [
        ("checkpoint_saved", 2), ("checkpoint_saved", 4), ("checkpoint_failed", 6)]
    assert "No space left on device" in events[-1]["error"]


@pytest.mark.timeout(300)
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path) -> None:
    # The save of step 4 is throttled to seconds: the kill lands inside it however slow this machine is (an
    # unthrottled save of this model takes milliseconds, and raced the kill).
    overrides = [*COMMON, "steps=200", "checkpoint.every_steps=1", "checkpoint.keep_last=50",
                 "checkpoint.throttle_writes_at=[4]", "checkpoint.throttle_mib_per_s=0.05"]
    ckpt_dir = tmp_path / "checkpoints"

    # NOTE: the other ranks start writing step 4 while rank 0 still commits step 3 (its manifest, the commit point,
    # then `latest`), so the kill can fall between the two: twice in a full make test here it left `latest` naming
    # step 2 beside a complete step 3. A window of the commit, not a lost save: `latest` is a hint, and a resume takes
    # the newest complete checkpoint, which is what is checked below.
    def save_in_flight():
        infos = catalog.list_checkpoints(ckpt_dir)
        return infos and infos[0].step == 4 and not infos[0].complete and any(i.complete for i in infos)

    job = start_training(tmp_path, "tiny-dp4.yaml", overrides, nproc=4)
    try:
        wait_for("a save in flight after a committed one", save_in_flight, 200, every_s=0.01)
    finally:
        kill_job(job)
    infos = catalog.list_checkpoints(ckpt_dir)
    killed, previous = infos[0], next(i for i in infos if i.complete)
    assert not killed.complete, "the save cut short has no manifest"
    # `latest` names a complete checkpoint, never the save cut short: the newest, or the one before it when the kill
    # fell inside the newest one's commit.
    complete = [i.path.name for i in infos if i.complete]
    assert _latest(tmp_path) in complete[:2], (_latest(tmp_path), complete)

    proc = subprocess.run(
        [sys.executable, "-m", "train", "--config", str(REPO / "configs" / "tiny-dp4.yaml"), "--run-dir",
         str(tmp_path), "--resume", "auto", "--set", "parallel.dp=1",
         *sum((["--set", o] for o in [*COMMON, f"steps={previous.step + 1}"]), [])],
        cwd=REPO, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resume: loading {previous.path} (step {previous.step})" in proc.stdout, proc.stdout[-2000:]
    assert f"deleting {killed.path}: a save cut short (no manifest)" in proc.stdout
    assert not killed.path.exists(), "a save cut short does not keep its space"
    assert f"loading {previous.path} (step {previous.step})" in proc.stdout
