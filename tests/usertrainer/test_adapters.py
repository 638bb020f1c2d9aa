"""The Lightning and Hugging Face adapters of megaheal.rank, end to end: a small model of each library (installed
from its package) trained on 4 CPU ranks (2 hosts x 2) under the embedded healer, through three faults in turn: a
rank killed (a crash, healed by a restart the library resumes from its own checkpoint), a rank stopped (a hang, its
steps no longer coming, healed the same way), and a corrupt value on rank 1 (a NaN, named from the steps the adapter
reports, and rolled back: the job restarts from the checkpoint before it that the adapter said was saved, named to
the script by MEGAHEAL_RESUME_STEP)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from healer.runner.loop import SelfHealingJob
from tests.usertrainer.jobs import faults_in_attempts, make_loop, rank_logs
from tests.usertrainer.scripts import HUGGINGFACE, LIGHTNING

pytestmark = pytest.mark.e2e
_built: list[SelfHealingJob] = []
POISON_STEP = 30
"""In the third attempt (after the crash and the hang, each of which cost a restart from a save at most 5 behind)."""


@pytest.fixture(autouse=True)
def _closed() -> Iterator[None]:
    yield
    while _built:
        _built.pop().close()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("library", ["lightning", "huggingface"])
def test_a_crash_a_hang_and_a_nan_of_a_librarys_trainer_are_each_named_and_healed(
        tmp_path: Path, library: str) -> None:
    ckpt = tmp_path / "ckpt"
    text, args, ready = {
        "lightning": (LIGHTNING, ["--ckpt-dir", str(ckpt)], ckpt / "last.ckpt"),
        "huggingface": (HUGGINGFACE, ["--out", str(ckpt)], ckpt / "checkpoint-5"),
    }[library]
    loop = make_loop(tmp_path, text, [*args, "--steps", "45", "--poison-step", str(POISON_STEP),
                                      "--poison-attempt", "2"], _built, hang={"floor": "6s", "k": 3})
    fired, hook = faults_in_attempts({0: (signal.SIGKILL, 3), 1: (signal.SIGSTOP, 2)}, ready)
    assert loop.run(timedelta(seconds=330), on_tick=hook) == "finished"  # type: ignore[arg-type]
    crash, hang, nan = sorted(loop.incidents(), key=lambda i: i.detected_at)
    assert (crash.kind, crash.state, crash.suspect_ranks) == ("crash", "resolved", [3]), crash.summary
    assert crash.detected_at >= fired[0] and "SIGKILL" in crash.summary
    assert (hang.kind, hang.state, hang.suspect_ranks) == ("hang", "resolved", [2]), hang.summary
    assert hang.detected_at >= fired[1]
    assert nan.kind == "nonfinite" and nan.state == "resolved" and nan.action == "rollback-and-skip", nan.summary
    # Lightning's loss is each rank's own: the poisoned rank is named. The Trainer logs a loss averaged over the ranks
    # and hides a NaN one (logging_nan_inf_filter); the gradient norm shows it, after the reduce, on every rank.
    assert nan.suspect_ranks == ([1] if library == "lightning" else [0, 1, 2, 3]), nan.summary
    assert nan.evidence["first_step"] == POISON_STEP, nan.evidence
    # The rollback went back to the newest checkpoint the adapter reported before the bad step (saved every 5).
    assert nan.resume_step is not None and nan.resume_step % 5 == 0 and nan.resume_step <= POISON_STEP, nan.resume_step
    # Each restart resumed from the library's own checkpoint: the newest after a crash or a hang (told by torchrun's
    # restart count), the one megaheal named after the rollback.
    for attempt in (1, 2, 3):
        logs = rank_logs(loop.sup.cfg.run_dir, attempt)
        assert logs.count(f"restart {attempt} resumes") == 4, logs
        assert "resumes from None" not in logs and "resumes False" not in logs, logs
    rolled = rank_logs(loop.sup.cfg.run_dir, 3)
    assert f"step={nan.resume_step}.ckpt" in rolled or f"checkpoint-{nan.resume_step}" in rolled, rolled
