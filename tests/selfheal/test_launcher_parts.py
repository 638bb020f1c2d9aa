"""The launcher's parts that need no training job: /proc reading of real processes (a real zombie, a real stopped
process), torchrun's failure report, the ranks' own records, and the coordinator's token check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ground import procfs
from ground.torchrun_report import parse_failures
from healer.launchers.coordinator import Coordinator, Unauthorized
from healer.observe.processes import ProcessView

pytestmark = pytest.mark.unit

REPORT = """[2026-11-30 03:14:02,118] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -9)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_03:14:02
  host      : box
  rank      : 2 (local_rank: 0)
  exitcode  : 1 (pid: 4301)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_03:14:01
  host      : box
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 4302)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4302
============================================================"""


def test_it_reads_each_failed_rank_from_the_agents_report() -> None:
    failures = parse_failures(REPORT.splitlines())
    assert [(f.rank, f.local_rank, f.pid, f.exit_code, f.signal) for f in failures] == [
        (2, 0, 4301, 1, None), (3, 1, 4302, None, signal.SIGKILL)]


def test_it_reads_state_cpu_rank_and_a_zombies_exit_status_from_proc() -> None:
    env = dict(os.environ, RANK="5")
    child = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"],
                             env=env)
    try:
        deadline = time.monotonic() + 20
        while (st := procfs.stat(child.pid)) is not None and st.state != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st is not None and st.state == "T" and procfs.worker_rank(child.pid) == 5
        assert child.pid in procfs.children(os.getpid())
        os.kill(child.pid, signal.SIGKILL)
        while (st := procfs.stat(child.pid)) is not None and st.state != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st is not None and st.state == "Z" and st.signal == signal.SIGKILL and st.exit_code is None
    finally:
        child.kill()
        child.wait()
    assert procfs.stat(child.pid) is None
    exiting = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    while (st := procfs.stat(exiting.pid)) is not None and st.state != "Z":
        time.sleep(0.05)
    assert st is not None and st.exit_code == 3 and st.signal is None
    exiting.wait()


def test_killing_or_restarting_needs_the_runs_token(tmp_path: Path) -> None:
    right = "the-right-token-0123456789"
    sup = Coordinator(Coordinator.Config(job="j", config="configs/demo.yaml", run_dir=tmp_path), ProcessView(), right,
                      epoch=1)
    for call in (lambda: sup.start("wrong", ("n1",)), lambda: sup.stop("wrong"),
                 lambda: sup.kill_rank("wrong", 0, signal.SIGKILL), lambda: sup.take_over("wrong")):
        with pytest.raises(Unauthorized):
            call()
    with pytest.raises(ValueError, match="token"):
        Coordinator(Coordinator.Config(job="j", config="c", run_dir=tmp_path), ProcessView(), token="short", epoch=1)


def test_the_first_bad_step_is_read_from_every_step_rank_0_recorded_not_from_sampled_heartbeats(tmp_path: Path) -> None:
    import json

    from healer.detect.loss_spike import LossSpike
    from healer.launchers.rank_records import first_nonfinite_step, first_spike_step

    losses = [5.0, 4.6, 4.3, 4.1, 3.9, 3.8, 3.7, 3.6, 3.55, 3.5, 3.45, 19.0, 18.0, float("nan")]
    (tmp_path / "ranks").mkdir()
    lines = [json.dumps({"step": s, "time": 100.0 + s, "loss": loss, "grad_norm": 1.0}) for s, loss in enumerate(losses)]
    (tmp_path / "ranks" / "0.jsonl").write_text("\n".join(["{\"step\": 3, \"ti", *lines]) + "\n")  # a torn line
    config = LossSpike.Config()
    assert first_spike_step(tmp_path, since=0.0, config=config) == 11
    assert first_nonfinite_step(tmp_path, since=0.0) == 13
    # Only the attempt that had the fault counts: after step 11 the window is too short to call a spike.
    assert first_spike_step(tmp_path, since=108.5, config=config) is None
    calm = LossSpike.Config(threshold=1000.0)
    assert first_spike_step(tmp_path, since=0.0, config=calm) is None


def test_a_step_an_aborted_warm_attempt_ended_after_the_next_began_is_not_the_next_attempts(tmp_path: Path) -> None:
    import json

    from healer.launchers.rank_records import first_nonfinite_step, first_step, highest_step
    from wire.journal import Start, append
    from wire.run_paths import RunPaths

    # Attempt 1 (warm) trained to step 15 with NaN weights from step 15; attempt 2 was planned at t=116 and rolled
    # back to step 12, while attempt 1's rank 0 still ended its steps 16 and 17 (NaN) at 116.2 and 116.4.
    rows = [(s, 100.0 + s, 1, 1.0 if s < 15 else float("nan")) for s in range(16)]
    rows += [(16, 116.2, 1, float("nan")), (17, 116.4, 1, float("nan")), (12, 117.0, 2, 1.0), (13, 117.5, 2, 1.0)]
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "0.jsonl").write_text("".join(
        json.dumps({"step": s, "time": t, "attempt": a, "loss": loss, "grad_norm": 1.0}) + "\n"
        for s, t, a, loss in rows))
    for attempt, at in ((1, 99.0), (2, 116.0)):
        append(RunPaths(tmp_path).journal, Start(job="j", attempt=attempt, at=at, nodes=["n1"], resume="memory"))
    assert first_step(tmp_path, 2) == 12 and highest_step(tmp_path, 2) == 13
    assert first_nonfinite_step(tmp_path, since=116.0, attempt=2) is None
    assert first_nonfinite_step(tmp_path, since=116.0) == 16  # what the time window alone made of it


def test_the_first_spiking_step_is_the_one_of_the_spike_the_detector_saw_not_an_earlier_blip(tmp_path: Path) -> None:
    import json

    from healer.detect.loss_spike import LossSpike
    from healer.launchers.rank_records import first_spike_step

    # A long run: a blip at step 12 that calmed down, 60 calm steps, then the spike the detector saw at step 75
    # (it began at 74, between two heartbeats). A rollback past step 12 would find no checkpoint that old.
    losses = [3.0 + 0.01 * (s % 3) for s in range(80)]
    losses[12] = 9.0
    losses[74:78] = [9.0, 9.5, 9.2, 9.1]
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "0.jsonl").write_text("".join(
        json.dumps({"step": s, "time": 100.0 + s, "loss": v, "grad_norm": 1.0}) + "\n" for s, v in enumerate(losses)))
    config = LossSpike.Config()
    assert first_spike_step(tmp_path, since=0.0, config=config) == 12
    assert first_spike_step(tmp_path, since=0.0, config=config, seen=75) == 74


def test_an_attempts_first_and_highest_step_are_read_from_rank_0s_records_within_its_window(tmp_path: Path) -> None:
    import json

    from healer.launchers.rank_records import first_step, highest_step

    journal = [{"event": "start", "job": "j", "attempt": 0, "at": 100.0}, {"event": "start", "job": "j", "attempt": 1,
                                                                           "at": 200.0}]
    (tmp_path / "supervisor").mkdir()
    (tmp_path / "supervisor" / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in journal))
    steps = [(s, 110.0 + s) for s in range(10)] + [(s, 210.0 + s) for s in range(8, 12)]
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "0.jsonl").write_text("".join(
        json.dumps({"step": s, "time": at, "loss": 2.0}) + "\n" for s, at in steps))
    # Attempt 1 resumed from the checkpoint of step 8: its first step is 8, whatever a heartbeat happened to sample.
    assert (first_step(tmp_path, 0), highest_step(tmp_path, 0)) == (0, 9)
    assert (first_step(tmp_path, 1), highest_step(tmp_path, 1)) == (8, 11)
    assert first_step(tmp_path, 2) is None
