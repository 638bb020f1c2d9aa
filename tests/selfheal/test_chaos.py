"""The chaos schedule: loading and validation, and the faults that need no training job (a real checkpoint
file truncated, a real process slowed by a SIGSTOP/SIGCONT duty cycle)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from ground import procfs
from ground.typedconfig import ConfigError
from healer.runner.chaos import (
    Chaos,
    Fault,
    Schedule,
    break_scratch,
    corrupt_newest_checkpoint,
    load_schedule,
)
from train.checkpoint.catalog import choose_resume
from train.config import load_config
from train.hang_faults import HangFault

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_schedule_loads_and_bad_ones_are_refused(tmp_path: Path) -> None:
    schedule = load_schedule(REPO / "configs" / "chaos-demo.yaml")
    assert [f.kind for f in schedule.faults] == ["kill", "hang-spin", "slow", "corrupt-checkpoint", "nan", "break-node"]
    assert schedule.faults[2].for_ == timedelta(seconds=60)
    assert schedule.start_overrides(16) == ("inject_nan_at_sample=800",
                                            "inject_hangs=[{mode: spin, at_step: 16, rank: 1}]")
    for text, message in (("faults: [{at_step: 3, kind: explode}]", "kind must be one of"),
                          ("faults: [{at_step: 3, kind: kill, rnak: 1}]", "rnak"),
                          ("faults: [{at_step: 9, kind: kill}, {at_step: 3, kind: kill}]", "at_step order"),
                          ("fault: []", "unknown key"),
                          ("faults: [{at_step: 3, kind: nan}, {at_step: 5, kind: nan}]", "at most one nan")):
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_schedule(tmp_path / "c.yaml")


def test_a_hang_the_rank_plays_is_set_at_start_as_a_training_override_the_trainer_reads(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("faults: [{at_step: 7, kind: hang-syscall, rank: 2}, {at_step: 9, kind: kill},"
                                     " {at_step: 12, kind: hang-spin, rank: 1}]")
    schedule = load_schedule(tmp_path / "c.yaml")
    (override,) = schedule.start_overrides(16)
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), [override])
    assert cfg.inject_hangs == [HangFault(mode="syscall", at_step=7, rank=2),
                                HangFault(mode="spin", at_step=12, rank=1)]
    noted: list[tuple[int, int]] = []
    chaos = Chaos(schedule, lambda rank, sig: noted.append((rank, sig)), tmp_path)
    chaos.tick(5)
    assert chaos.fired == []
    chaos.tick(6)  # every rank finished step 6: rank 2 hangs in step 7, which nobody finishes
    assert [f["kind"] for f in chaos.fired] == ["hang-syscall"] and noted == [], "nothing sent: the rank plays it"


def make_checkpoint(ckpt_dir: Path, step: int) -> None:
    d = ckpt_dir / f"step-{step:08d}"
    d.mkdir(parents=True)
    files = []
    for rank in range(2):
        (d / f"__{rank}_0.distcp").write_bytes(b"x" * (1000 + rank))
        files.append({"name": f"__{rank}_0.distcp", "size": 1000 + rank})
    (d / "manifest.json").write_text(json.dumps({"step": step, "files": files}))


def test_corrupting_the_newest_checkpoint_makes_resume_fall_back_to_the_one_before(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    make_checkpoint(ckpt, 5)
    make_checkpoint(ckpt, 10)
    kills: list[tuple[int, int]] = []
    chaos = Chaos(load_schedule_text(tmp_path, "faults: [{at_step: 12, kind: corrupt-checkpoint, rank: 1}]"),
                  lambda rank, sig: kills.append((rank, sig)) or 4242, ckpt)
    chaos.tick(11)
    assert chaos.pending and not kills
    chaos.tick(12)
    assert kills == [(1, signal.SIGKILL)] and chaos.fired[0]["corrupted"].endswith("step-00000010/__1_0.distcp")
    choice = choose_resume(ckpt)
    assert choice.checkpoint is not None and choice.checkpoint.step == 5 and "size" in choice.skipped[0][1]
    assert corrupt_newest_checkpoint(tmp_path / "none") is None


def load_schedule_text(tmp_path: Path, text: str) -> Schedule:
    (tmp_path / "s.yaml").write_text(text)
    return load_schedule(tmp_path / "s.yaml")


def test_slow_stops_and_continues_a_real_process_for_its_duration(tmp_path: Path) -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        chaos = Chaos(load_schedule_text(tmp_path, "faults: [{at_step: 0, kind: slow, duty: 0.8, for: 2s}]"),
                      lambda rank, sig: (busy.send_signal(sig), busy.pid)[1], tmp_path)
        chaos.tick(0)
        seen = set()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            st = procfs.stat(busy.pid)
            assert st is not None
            seen.add(st.state)
            time.sleep(0.01)
        assert "T" in seen and "R" in seen  # stopped most of the time, running in between
        time.sleep(1.0)
        states = {procfs.stat(busy.pid).state for _ in range(20) if not time.sleep(0.01)}  # type: ignore[union-attr, func-returns-value]
        assert states == {"R"}  # the duty cycle ended with the rank running
    finally:
        busy.kill()
        busy.wait()


def test_slow_job_stops_and_continues_every_rank_together_and_leaves_them_running(tmp_path: Path) -> None:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        schedule = load_schedule_text(tmp_path, "faults: [{at_step: 0, kind: slow-job, duty: 0.7, for: 2s}]")
        with pytest.raises(ValueError, match="slow-job faults need the job's world size"):
            Chaos(schedule, lambda rank, sig: 0, tmp_path)
        chaos = Chaos(schedule, lambda rank, sig: (busy[rank].send_signal(sig), busy[rank].pid)[1], tmp_path,
                      world_size=3)
        chaos.tick(0)
        assert chaos.fired[0]["pids"] == [p.pid for p in busy]
        seen = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            seen.append(tuple(procfs.stat(p.pid).state for p in busy))  # type: ignore[union-attr]
            time.sleep(0.01)
        assert ("T", "T", "T") in seen and ("R", "R", "R") in seen, seen
        # NOTE: a read of three stat files can fall between the first kill(2) of a loop and the last; not often.
        mixed = [states for states in seen if len(set(states)) > 1]
        assert len(mixed) <= len(seen) // 4, seen
        time.sleep(1.0)
        assert {procfs.stat(p.pid).state for p in busy} == {"R"}  # type: ignore[union-attr]
    finally:
        for p in busy:
            p.kill()
            p.wait()


def test_break_node_turns_the_scratch_directory_into_a_file_and_kills_the_rank(tmp_path: Path) -> None:
    scratch = tmp_path / "nodes" / "n2" / "tmp"
    (scratch / "cache").mkdir(parents=True)
    killed: list[tuple[int, int]] = []
    schedule = Schedule(faults=[Fault(at_step=4, kind="break-node", rank=2)])
    with pytest.raises(ValueError, match="break-node and freeze faults need the job's hosts on this machine"):
        Chaos(schedule, lambda rank, sig: 0, tmp_path / "checkpoints")
    chaos = Chaos(schedule, lambda rank, sig: killed.append((rank, sig)) or 4242, tmp_path / "checkpoints",
                  scratch_of=lambda rank: scratch)
    chaos.tick(3)
    assert scratch.is_dir() and not killed  # not yet: step 4 is not reached
    chaos.tick(4)
    assert scratch.is_file() and killed == [(2, signal.SIGKILL)]
    assert chaos.fired[0]["broken"] == str(scratch) and chaos.fired[0]["pid"] == 4242
    assert break_scratch(scratch) == scratch and scratch.is_file()  # breaking it again is harmless


def test_a_freeze_waits_while_the_rank_saves_and_then_leaves_it_stuck_in_the_kernel(tmp_path: Path) -> None:
    # A rank frozen inside a save looks like one writing to a slow store (the hang detector waits that out for
    # minutes): the fault is frozen only once the rank is out of its save, as its phase file says.
    scratch = tmp_path / "nodes" / "n2" / "tmp"
    phase_dir = scratch / "megaheal-phase" / "job-attempt-001"
    marker = tmp_path / "saved"
    rank = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, pathlib\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from wire.phase_now import PhaseBeacon\n"
        f"beacon = PhaseBeacon({str(phase_dir)!r}, rank=3)\n"
        f"marker = pathlib.Path({str(marker)!r})\n"
        "beacon.enter('checkpoint_save', step=28)\n"
        "while not marker.exists(): time.sleep(0.01)\n"
        "beacon.enter('forward_backward', step=29)\n"
        "while True: time.sleep(0.01)\n")])
    chaos = Chaos(Schedule(faults=[Fault(at_step=29, kind="freeze", rank=3)]),
                  lambda r, sig: (rank.send_signal(sig), rank.pid)[1], tmp_path / "checkpoints",
                  scratch_of=lambda r: scratch)
    try:
        deadline = time.monotonic() + 20
        while not list(phase_dir.glob(f"{rank.pid}.phase")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # in its save now
        chaos.tick(29)
        assert chaos.fired == [] and len(chaos.pending) == 1, "not frozen while it saves"
        state = procfs.stat(rank.pid)
        assert state is not None and state.state in ("R", "S"), state
        marker.touch()
        time.sleep(0.5)  # it left the save for a step
        chaos.tick(30)
        assert [f["kind"] for f in chaos.fired] == ["freeze"] and not chaos.pending
        state = procfs.stat(rank.pid)
        assert state is not None and state.state == "D", state
    finally:
        rank.kill()
        chaos.close()  # thawed: the SIGKILL lands
        rank.wait(timeout=10)


def test_a_bad_batch_and_a_hosts_bit_flips_are_set_at_start_as_overrides_the_trainer_reads(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("faults: [{at_step: 4, kind: bad-batch}, {at_step: 9, kind: bit-flip, rank: 3, "
                                     "rate: 0.5}]")
    schedule = load_schedule(tmp_path / "c.yaml")
    overrides = schedule.start_overrides(16, lambda rank: f"n{1 + rank // 2}")
    assert overrides == ("inject_bad_sample=64", "inject_matmul_flips=[{node: n2, from_step: 9, rate: 0.5}]")
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), list(overrides))
    assert cfg.inject_bad_sample == 64 and [(f.node, f.from_step, f.rate) for f in cfg.inject_matmul_flips] == [
        ("n2", 9, 0.5)]
    with pytest.raises(ValueError, match="need the job's hosts"):
        schedule.start_overrides(16)
    (tmp_path / "c.yaml").write_text("faults: [{at_step: 4, kind: bit-flip, rate: 0}]")
    with pytest.raises(ConfigError, match="rate must be in"):
        load_schedule(tmp_path / "c.yaml")
