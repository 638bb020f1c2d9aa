"""Detectors over synthetic heartbeat streams (tests/selfheal/streams.py) and the launcher's view of the processes."""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import numpy as np
import pytest

from healer.decide.rules import load_rules
from healer.detect.collective_slowdown import CollectiveSlowdown
from healer.detect.crash import Crash
from healer.detect.gpu_fault import GpuFault
from healer.detect.hang import Hang
from healer.detect.host_lost import HostLost
from healer.detect.job_slowdown import JobSlowdown
from healer.detect.logtail import classify
from healer.detect.loss_spike import LossSpike, robust_z
from healer.detect.nonfinite import PROGRAM_SETTLE, NonFinite
from healer.detect.phases import PhaseTable
from healer.detect.registry import default_registry
from healer.detect.straggler import Straggler, attribute, attribute_by_stage
from healer.observe.heartbeats import HeartbeatTable
from healer.observe.processes import ProcessExit, ProcessState
from tests.healer.helpers import ManualClock
from tests.selfheal.streams import JobStream
from wire.telemetry import AttemptReport, RankExit

pytestmark = pytest.mark.unit

NODES = {"n1": [0, 1], "n2": [2, 3]}


def stream(**kw: object) -> JobStream:
    clock = ManualClock()
    return JobStream(table=HeartbeatTable(clock=clock), clock=clock, nodes=dict(NODES), **kw)  # type: ignore[arg-type]


# ---- crash -----------------------------------------------------------------------------------------------

TRACEBACK = ["Traceback (most recent call last):", '  File "train/trainer.py", line 3, in step',
             "    loss.backward()", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
GLOO_PEER = ["Traceback (most recent call last):", '  File "x.py", line 1, in f',
             ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
              "[127.0.0.1]:4242")]


def test_it_classifies_log_tails_by_cause() -> None:
    assert classify(1, None, TRACEBACK).category == "oom"
    assert classify(1, None, TRACEBACK).detail == "torch.OutOfMemoryError"
    gloo = classify(1, None, GLOO_PEER)
    assert (gloo.category, gloo.detail, gloo.peer_failure) == ("gloo", "RuntimeError", True)
    assert classify(None, signal.SIGSEGV, []).category == "segfault"
    assert classify(1, None, ["Fatal Python error: Segmentation fault"]).category == "segfault"
    exc = classify(1, None, ["Traceback (most recent call last):", "  x", "ValueError: bad layout"])
    assert (exc.category, exc.detail) == ("python-exception", "ValueError")
    assert classify(None, signal.SIGKILL, ["step 4 loss 3.2"]).detail == "SIGKILL"
    nccl = classify(1, None, ["torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970"])
    assert nccl.category == "nccl"
    assert classify(3, None, ["bye"]).category == "exit-code"
    assert classify(None, None, ["step 9 loss 3.1"]).category == "unknown"  # vanished, no status, no clue


def test_crash_names_the_first_rank_that_died_not_the_peers_that_followed() -> None:
    table = HeartbeatTable(clock=ManualClock())
    view = table.processes
    view.started("job", 0)
    detector = Crash(Crash.Config())
    assert detector.evaluate(table, 100.0).firing == ()
    view.record_exit(ProcessExit(job="job", attempt=0, node="n1", rank=0, pid=10, at=100.5, exit_code=1,
                                 log_tail=tuple(GLOO_PEER)))
    view.record_exit(ProcessExit(job="job", attempt=0, node="n2", rank=3, pid=13, at=100.2, exit_code=None,
                                 signal=signal.SIGKILL, log_tail=("step 7 loss 3.1",)))
    view.record_exit(ProcessExit(job="job", attempt=0, node="n1", rank=1, pid=11, at=100.6, exit_code=None,
                                 signal=signal.SIGTERM, expected=True))
    (f,) = detector.evaluate(table, 101.0).firing
    assert f.key == "job/attempt-0" and f.node == "n2"
    assert f.evidence["suspect_rank"] == 3 and f.evidence["signal"] == "SIGKILL"
    assert f.evidence["class"]["category"] == "signal" and len(f.evidence["failed"]) == 2
    settled = Crash(Crash.Config(settle=timedelta(seconds=5)))
    assert settled.evaluate(table, 101.0).firing == ()
    view.started("job", 1)  # restarted: the old attempt's crash is over
    result = detector.evaluate(table, 102.0)
    assert result.firing == () and result.healthy == {"job/attempt-0"}


def test_a_rank_the_launcher_kills_to_replace_it_is_no_crash_and_a_rank_killed_otherwise_still_is() -> None:
    # A warm restart kills a hung rank before the next attempt starts: its agent may report the exit while the old
    # attempt is still the job's current one.
    table = HeartbeatTable(clock=ManualClock())
    view = table.processes
    view.started("job", 3)
    view.replacing("job", 3, (2,))
    view.record_exit(ProcessExit(job="job", attempt=3, node="n1", rank=2, pid=12, at=100.0, exit_code=None,
                                 signal=signal.SIGKILL))
    assert Crash(Crash.Config()).evaluate(table, 101.0).firing == ()
    view.record_exit(ProcessExit(job="job", attempt=3, node="n2", rank=5, pid=15, at=100.5, exit_code=None,
                                 signal=signal.SIGKILL))
    (f,) = Crash(Crash.Config()).evaluate(table, 102.0).firing
    assert f.evidence["suspect_rank"] == 5


# ---- hang ------------------------------------------------------------------------------------------------

def test_hang_fires_after_max_floor_k_p99_and_names_the_stopped_rank() -> None:
    s = stream(compute=2.0)  # ~2.2 s steps: k x p99 (3 x ~2.3 s) is above the 5 s floor
    detector = Hang(Hang.Config(floor=timedelta(seconds=5), k=3.0, min_samples=5))
    for _ in range(8):
        s.advance(seconds=2.2)
        assert detector.evaluate(s.table, s.clock.now).firing == ()
    timeout, p99 = detector.timeout_s("job")
    assert p99 is not None and 2.0 < p99 < 2.5 and timeout == pytest.approx(3 * p99)
    s.table.processes.started("job", 0)
    s.table.processes.update_states([
        ProcessState(job="job", attempt=0, node=n, rank=r, pid=1000 + r, state="T" if r == 2 else "S",
                     cpu_seconds=1.0, sampled_at=s.clock.now) for n, rs in NODES.items() for r in rs])
    waited = 0.0
    while not detector.evaluate(s.table, s.clock.now).firing:
        s.clock.now += 1.0
        waited += 1.0
        s.send(age=waited)  # the sidecars still post: the ranks' records just get older
        assert waited < 30
    assert timeout - 1 <= waited <= timeout + 2
    (f,) = detector.evaluate(s.table, s.clock.now).firing
    assert f.evidence["suspect_ranks"] == [2] and f.node == "n2" and f.evidence["suspected_by"].startswith("process")
    s.advance()  # progress again
    assert detector.evaluate(s.table, s.clock.now).healthy == {"job"}


def test_without_a_launcher_hang_names_the_rank_the_sidecars_heartbeats_say_is_stopped() -> None:
    # The healer on its own (docker-compose.yml's): no node agent reports process states, the sidecars do.
    s = stream()
    detector = Hang(Hang.Config(floor=timedelta(seconds=5), k=3.0, min_samples=5))
    for _ in range(8):
        s.advance()
        assert detector.evaluate(s.table, s.clock.now).firing == ()
    assert not s.table.processes.jobs(), "no launcher"
    s.stopped = {3}
    waited = 0.0
    while not (firing := detector.evaluate(s.table, s.clock.now).firing):
        s.clock.now += 1.0
        waited += 1.0
        s.send(age=waited)  # every rank's record ages alike: only the kernel state singles rank 3 out
        assert waited < 30
    (f,) = firing
    assert (f.evidence["suspect_ranks"], f.node, f.evidence["suspected_by"]) == ([3], "n2", "process stopped (state T)")
    assert {r["rank"]: r["proc_state"] for r in f.evidence["ranks"]} == {0: "S", 1: "S", 2: "S", 3: "T"}


def test_hang_uses_the_floor_until_it_has_learned_and_ignores_a_job_that_is_starting() -> None:
    s = stream()
    detector = Hang(Hang.Config(floor=timedelta(seconds=10)))
    s.advance()
    assert detector.evaluate(s.table, s.clock.now).healthy == {"job"}
    assert detector.timeout_s("job") == (10.0, None)
    s.clock.now += 9.5
    assert detector.evaluate(s.table, s.clock.now).firing == ()
    s.clock.now += 1.0
    (f,) = detector.evaluate(s.table, s.clock.now).firing
    assert f.evidence["suspected_by"] == "all ranks alike" and f.evidence["step"] == 1
    starting = stream()
    starting.send()
    starting.table.ingest({"schema": 1, "node": "n3", "seq": 0, "sent_at": 0, "ranks": [
        {"job": "job", "rank": 9, "alive": True, "last_seen_age_s": 0.0, "step": None}]})
    starting.clock.now += 100
    assert Hang(Hang.Config()).evaluate(starting.table, starting.clock.now).firing == ()


def _in_phase(s: JobStream, phase: str | None, since: float) -> None:
    """The attempt's ranks as the agents see them, each in `phase` (from its phase file) since `since`."""
    s.table.processes.update_states([
        ProcessState(job="job", attempt=0, node=n, rank=r, pid=1000 + r, state="S", cpu_seconds=1.0,
                     sampled_at=s.clock.now, phase=phase, phase_step=s.step, phase_entered=since)
        for n, rs in NODES.items() for r in rs])


def _stalled_until_fired(s: JobStream, detector: Hang, limit: int, phase: str | None = None,
                         stopped: int | None = None) -> int | None:
    """Seconds of no progress until `detector` fires (None: not within `limit`), the ranks in `phase` throughout
    (rank `stopped` SIGSTOPped in it: state T)."""
    since = s.clock.now
    for t in range(1, limit + 1):
        s.clock.now += 1.0
        s.send()
        _in_phase(s, phase, since)
        if stopped is not None:
            s.table.processes.update_states([replace(st, state="T") if st.rank == stopped else st
                                             for st in s.table.processes.states()])
        if detector.evaluate(s.table, s.clock.now).firing:
            return t
    return None


def _hang_past_its_first_steps() -> tuple[JobStream, Hang]:
    """A placed job 6 steps in (past min_samples), with a 5-s step floor and a 30-s floor for a save."""
    s = stream()
    _placed(s)
    hang = Hang(Hang.Config(floor=timedelta(seconds=5), phase_floors={"checkpoint_save": timedelta(seconds=30)}))
    for _ in range(6):
        s.advance()
        _in_phase(s, "forward_backward", s.clock.now)
        hang.evaluate(s.table, s.clock.now)
    return s, hang


def test_a_checkpoint_save_is_timed_by_what_saves_took_and_a_hang_in_a_step_by_the_step_time() -> None:
    s, hang = _hang_past_its_first_steps()
    # The first save: 20 s, past the 5 s step timeout, under the 30 s save floor. No hang.
    assert _stalled_until_fired(s, hang, 20, "checkpoint_save") is None
    s.advance()
    _in_phase(s, "data_wait", s.clock.now)  # seen to leave the save: it took 20 s
    assert hang.evaluate(s.table, s.clock.now).healthy == {"job"}
    assert hang.phase_timeout_s("job", "checkpoint_save") == (60.0, 20.0)  # k x 20 s, above the floor
    # A save stalled past that is a hang, timed as a save; a stall inside a step fires at the step's timeout.
    fired = _stalled_until_fired(s, hang, 70, "checkpoint_save")
    assert fired is not None and 60 <= fired <= 62
    (f,) = hang.evaluate(s.table, s.clock.now).firing
    assert f.evidence["timed_as"] == "checkpoint_save" and "that of checkpoint_save" in f.summary
    assert f.evidence["ranks"][0]["phase"] == "checkpoint_save"
    s.advance()
    _in_phase(s, "data_wait", s.clock.now)
    hang.evaluate(s.table, s.clock.now)
    assert _stalled_until_fired(s, hang, 10, "forward_backward") == 6


def test_a_rank_stopped_inside_a_save_is_timed_as_a_step_not_as_the_save() -> None:
    s, hang = _hang_past_its_first_steps()
    # Every rank in the save, rank 2 SIGSTOPped in it: the step's timeout (the floor), not the save's 30 s.
    assert _stalled_until_fired(s, hang, 30, "checkpoint_save", stopped=2) == 6
    (f,) = hang.evaluate(s.table, s.clock.now).firing
    assert f.evidence["timed_as"] == "step" and f.evidence["suspect_ranks"] == [2]


def test_a_save_does_not_count_in_the_step_time_it_was_timed_in() -> None:
    s = stream(shape=lambda rank, step: {"checkpoint": 40.0} if step % 5 == 0 else {})
    hang = Hang(Hang.Config(floor=timedelta(seconds=5)))
    for _ in range(20):
        s.advance()
        hang.evaluate(s.table, s.clock.now)
    timeout, p99 = hang.timeout_s("job")
    assert p99 is not None and p99 < 1.0 and timeout == 5.0


def test_under_a_launcher_an_attempt_that_never_finishes_its_first_step_is_a_hang_at_the_first_step_timeout() -> None:
    s = stream()
    _placed(s)
    hang = Hang(Hang.Config(floor=timedelta(seconds=5), phase_floors={"first_step": timedelta(seconds=40)}))
    # The ranks are running (their agents report them) and none has said hello: no heartbeat, no step.
    fired = None
    for t in range(1, 50):
        s.clock.now += 1.0
        _in_phase(s, "restore" if t < 10 else "forward_backward", s.clock.now - t)
        if hang.evaluate(s.table, s.clock.now).firing:
            fired = t
            break
    assert fired == 42  # first seen at 1 s, fired past 40 s after it
    (f,) = hang.evaluate(s.table, s.clock.now).firing
    assert f.evidence["timed_as"] == "first_step" and f.evidence["step"] is None
    assert "before the attempt's first step" in f.summary and f.evidence["suspected_by"] == "all ranks alike"
    # Ranks 0-1 got through it and rank 3 did not: 3 is named.
    s.send(only={0, 1, 2})
    (f,) = hang.evaluate(s.table, s.clock.now).firing
    assert f.evidence["suspect_ranks"] == [3] and f.evidence["suspected_by"] == "not through its first step"
    assert f.node == "n2"


def test_the_first_step_is_learned_and_kept_across_a_restart() -> None:
    s = stream()
    _placed(s)
    hang = Hang(Hang.Config(floor=timedelta(seconds=5), phase_floors={"first_step": timedelta(seconds=10)}))
    _in_phase(s, "startup", s.clock.now)
    hang.evaluate(s.table, s.clock.now)
    s.clock.now += 8.0
    _in_phase(s, "forward_backward", s.clock.now)
    assert hang.evaluate(s.table, s.clock.now).firing == ()
    s.advance()  # through the first step 9 s after the ranks were first seen
    _in_phase(s, "data_wait", s.clock.now)
    hang.evaluate(s.table, s.clock.now)
    assert hang.phase_timeout_s("job", "first_step") == (27.0, 9.0)
    s.table.processes.started("job", 1, tuple(s.nodes), s.clock.now)  # a restart: the learned first step stays
    hang.evaluate(s.table, s.clock.now)
    assert hang.phase_timeout_s("job", "first_step") == (27.0, 9.0)


def test_a_phase_floor_must_be_positive() -> None:
    with pytest.raises(ValueError, match="phase_floors must be > 0, got restore"):
        Hang.Config(phase_floors={"restore": timedelta(0)})
    assert Hang.Config(phase_floors={"restore": timedelta(seconds=9)}).phase_floors["checkpoint_save"] \
        == timedelta(minutes=5)


# ---- straggler -------------------------------------------------------------------------------------------

def test_straggler_names_a_slow_computing_rank_only_after_k_windows_with_the_phase_table() -> None:
    s = stream(shape=lambda rank, step: {"forward_backward": 0.4} if rank == 3 and step > 10 else {})
    detector = Straggler(Straggler.Config(window=5, consecutive=3))
    fired_at = None
    for _ in range(40):
        s.advance()
        result = detector.evaluate(s.table, s.clock.now)
        if result.firing and fired_at is None:
            fired_at = s.step
    assert fired_at is not None and fired_at >= 10 + 3 * 5  # three full windows after the slowdown began
    (f,) = detector.evaluate(s.table, s.clock.now).firing
    assert f.evidence["suspect_rank"] == 3 and f.node == "n2" and f.evidence["cause"] == "compute"
    table = {row["rank"]: row for row in f.evidence["phase_table"]}
    assert table[3]["compute_s"] > 1.5 * table[0]["compute_s"]
    assert table[3]["dp_reduce_s"] < table[0]["dp_reduce_s"]  # the others wait for it in the reduce


def test_a_straggler_on_another_host_is_another_finding_and_the_first_hosts_is_healthy_again() -> None:
    # Rank 3 (n2) slow from step 10, then rank 1 (n1) instead from step 40: two keys, the first healthy again.
    s = stream(shape=lambda rank, step: {"forward_backward": 0.4}
               if (rank == 3 and 10 < step <= 40) or (rank == 1 and step > 40) else {})
    detector = Straggler(Straggler.Config(window=5, consecutive=2))
    keys, healthy = [], set()
    for _ in range(80):
        s.advance()
        result = detector.evaluate(s.table, s.clock.now)
        keys += [f.key for f in result.firing if f.key not in keys]
        healthy |= result.healthy
    assert keys == ["job/n2", "job/n1"], keys
    assert healthy == {"job/n2"}, healthy


def test_straggler_finds_a_rank_that_enters_the_reduce_late_when_compute_is_flat() -> None:
    # Rank 1 loses time outside the timed phases (descheduled before the reduce): compute and data look flat,
    # only the others' waiting in the reduce shows who they wait for.
    s = stream(late={1: 0.15})
    detector = Straggler(Straggler.Config(window=4, consecutive=2))
    for _ in range(20):
        s.advance()
        detector.evaluate(s.table, s.clock.now)
    (f,) = detector.evaluate(s.table, s.clock.now).firing
    assert f.evidence["suspect_rank"] == 1 and f.evidence["cause"] == "late-reduce" and f.node == "n1"
    s.late = {}
    for _ in range(8):
        s.advance()
        detector.evaluate(s.table, s.clock.now)
    assert detector.evaluate(s.table, s.clock.now).healthy == {"job/n1"}  # the key of the host it named


def test_a_uniform_slowdown_is_no_straggler_but_a_collective_slowdown() -> None:
    s = stream()
    straggler = Straggler(Straggler.Config(window=5, consecutive=2))
    coll = CollectiveSlowdown(CollectiveSlowdown.Config(window=5, baseline_windows=3, consecutive=2))
    fired = []
    for i in range(60):
        if i == 25:
            s.transfer = 0.2  # the network got 10x slower for everyone
        s.advance()
        assert straggler.evaluate(s.table, s.clock.now).firing == ()
        if coll.evaluate(s.table, s.clock.now).firing:
            fired.append(s.step)
    assert fired and fired[0] > 25
    f = coll.evaluate(s.table, s.clock.now).firing[0]
    assert f.evidence["factor"] > 5 and f.evidence["baseline_transfer_s"] == pytest.approx(0.02, rel=0.15)
    s.transfer = 0.02
    for _ in range(10):
        s.advance()
        coll.evaluate(s.table, s.clock.now)
    assert coll.evaluate(s.table, s.clock.now).firing == ()


def slowdown_steps(s: JobStream, coll: CollectiveSlowdown, change_at: int, change: Callable[[], None],
                   steps: int = 60) -> list[int]:
    """The steps at which the detector fired, `change` applied at step `change_at`."""
    fired = []
    for i in range(steps):
        if i == change_at:
            change()
        s.advance()
        if coll.evaluate(s.table, s.clock.now).firing:
            fired.append(s.step)
    return fired


def two_stages() -> JobStream:
    """6 ranks on 3 hosts, 2 pipeline stages (ranks 0-2 and 3-5), as on the multi-host bed."""
    clock = ManualClock()
    return JobStream(table=HeartbeatTable(clock=clock), clock=clock, nodes={"h1": [0, 1], "h2": [2, 3], "h3": [4, 5]},
                     mesh=lambda r, world: {"pp": r // 3, "dp": r % 3, "tp": 0})


def test_a_slow_link_under_one_pipeline_stage_is_a_collective_slowdown() -> None:
    s = two_stages()
    coll = CollectiveSlowdown(CollectiveSlowdown.Config(window=5, baseline_windows=3, consecutive=2))
    slow_link = False

    def stage1_slow(rank: int, step: int) -> dict[str, float]:
        return {"dp_reduce": 0.2} if slow_link and rank >= 3 else {}

    def slow() -> None:
        nonlocal slow_link
        slow_link = True

    s.shape = stage1_slow
    fired = slowdown_steps(s, coll, 25, slow)
    assert fired and fired[0] > 25, "stage 0's fast reduce must not hide stage 1's slow one"
    f = coll.evaluate(s.table, s.clock.now).firing[0]
    assert f.evidence["transfer_s"] == pytest.approx(0.2, rel=0.05) and f.evidence["factor"] > 5


def test_a_slow_link_that_also_slows_its_pipeline_peers_and_the_other_stages_norm_is_a_collective_slowdown() -> None:
    # As measured on the bed with one host's link at 100 Mbit/s: stage 1's reduce 15x slower; stage 0 waits for it
    # in the global gradient norm's all-reduce; a rank sending activations over the slow link computes 1.4x the
    # median (pipeline sends are timed in forward/backward). Under load, that rank used to veto the finding.
    s = two_stages()
    coll = CollectiveSlowdown(CollectiveSlowdown.Config(window=5, baseline_windows=3, consecutive=2))
    slow_link = False

    def measured(rank: int, step: int) -> dict[str, float]:
        if not slow_link:
            return {}
        if rank >= 3:
            return {"dp_reduce": 0.3}
        return {"grad_norm_clip": 0.3, **({"forward_backward": 0.16 * 1.5} if rank == 1 else {})}

    def slow() -> None:
        nonlocal slow_link
        slow_link = True

    s.shape = measured
    fired = slowdown_steps(s, coll, 25, slow)
    assert fired and fired[0] > 25
    assert coll.evaluate(s.table, s.clock.now).firing[0].evidence["factor"] > 5


def test_a_straggler_that_holds_its_group_in_the_reduce_is_no_collective_slowdown() -> None:
    # Rank 4 descheduled for 0.1 s a step, now and then inside the reduce: its group's reduce grows by at most what
    # its compute did, and that is the straggler detector's case.
    s = two_stages()
    coll = CollectiveSlowdown(CollectiveSlowdown.Config(window=5, baseline_windows=3, consecutive=2))
    held = False

    def stalled(rank: int, step: int) -> dict[str, float]:
        if not held or rank < 3:
            return {}
        stall = {"dp_reduce": 0.02 + 0.08}  # rank 4 too: it was stopped inside the reduce
        return {"forward_backward": 0.16 + 0.1, **stall} if rank == 4 else stall

    def hold() -> None:
        nonlocal held
        held = True

    s.shape = stalled
    assert slowdown_steps(s, coll, 25, hold) == []


def test_a_slow_network_on_a_machine_that_also_got_somewhat_slower_is_still_a_collective_slowdown() -> None:
    s = stream()
    coll = CollectiveSlowdown(CollectiveSlowdown.Config(window=5, baseline_windows=3, consecutive=2))

    def both() -> None:
        s.compute, s.transfer = 0.2 * 1.6, 0.2  # compute 1.6x (a busy shared machine), the network 10x

    assert slowdown_steps(s, coll, 25, both)


def test_a_collective_slowdown_is_not_healthy_while_the_cpus_get_busy_or_the_transfer_wavers_near_the_threshold() -> None:
    s = stream()
    coll = CollectiveSlowdown(CollectiveSlowdown.Config(window=5, baseline_windows=3, consecutive=2))

    def network() -> None:
        s.transfer = 0.2

    assert slowdown_steps(s, coll, 25, network, steps=50)
    s.compute = 0.2 * 3  # a network test beside the training takes the CPUs: not slow by the rule, nor healthy
    for _ in range(15):
        s.advance()
        ev = coll.evaluate(s.table, s.clock.now)
        assert "job" not in ev.healthy
    s.compute, s.transfer = 0.2, 0.02 * 1.8  # between clearing (1.5 x) and firing (2 x): a wavering slow link
    for _ in range(15):
        s.advance()
        assert "job" not in coll.evaluate(s.table, s.clock.now).healthy
    s.transfer = 0.02
    healthy = set()
    for _ in range(15):
        s.advance()
        healthy |= coll.evaluate(s.table, s.clock.now).healthy
    assert healthy == {"job"}, "healthy once the transfer is back"


def test_a_machine_slower_as_a_whole_is_no_collective_slowdown() -> None:
    s = stream()
    coll = CollectiveSlowdown(CollectiveSlowdown.Config(window=5, baseline_windows=3, consecutive=2))

    def everything() -> None:
        s.compute, s.transfer = 0.2 * 2.5, 0.02 * 2.5  # compute and transfer alike: the CPUs, not the network

    assert slowdown_steps(s, coll, 25, everything) == []


# ---- the whole job slower ------------------------------------------------------------------------------------

def job_slowdown_run(s: JobStream, change_at: int, change: Callable[[], None], steps: int = 70,
                     undo_at: int | None = None, undo: Callable[[], None] | None = None
                     ) -> tuple[list[int], list[int], list[int], JobSlowdown]:
    """The steps at which job_slowdown, straggler and collective_slowdown fired, `change` applied at `change_at`."""
    job = JobSlowdown(JobSlowdown.Config())
    straggler = Straggler(Straggler.Config(window=5, consecutive=2))
    coll = CollectiveSlowdown(CollectiveSlowdown.Config(window=5, baseline_windows=3, consecutive=2))
    fired: tuple[list[int], list[int], list[int]] = ([], [], [])
    for i in range(steps):
        if i == change_at:
            change()
        if i == undo_at and undo is not None:
            undo()
        s.advance()
        for detector, out in zip((job, straggler, coll), fired):
            if detector.evaluate(s.table, s.clock.now).firing:
                out.append(s.step)
    return (*fired, job)


def test_a_machine_slower_as_a_whole_is_a_job_slowdown_named_by_its_phase_and_no_straggler_or_network() -> None:
    s = stream()

    def everything() -> None:
        s.compute, s.transfer = 0.2 * 2.5, 0.02 * 2.5  # the CPUs (a power cap on every GPU), not one rank or the net

    job, straggler, coll, detector = job_slowdown_run(s, 30, everything, steps=60)
    assert job and job[0] > 30 and straggler == [] and coll == [], (job, straggler, coll)
    f = detector.evaluate(s.table, s.clock.now).firing[0]
    assert f.key == "job" and f.node is None and f.evidence["phase"] == "compute", f.evidence
    assert f.evidence["factor"] == pytest.approx(2.5, rel=0.1) and f.evidence["throughput"] == pytest.approx(0.4, rel=0.1)
    assert f.evidence["baseline_step_s"] == pytest.approx(0.227, rel=0.05) and f.evidence["windows"] >= 3
    assert "throughput x0.4" in f.summary and "compute grew by" in f.summary, f.summary
    s.compute, s.transfer = 0.2, 0.02
    seen_healthy = False
    for _ in range(12):
        s.advance()
        now = detector.evaluate(s.table, s.clock.now)
        seen_healthy |= "job" in now.healthy
    assert now.firing == () and seen_healthy


def test_a_slower_data_pipeline_is_a_job_slowdown_in_data_wait() -> None:
    s = stream(shape=lambda rank, step: {"data_wait": 0.3} if step > 30 else {})
    job, straggler, coll, detector = job_slowdown_run(s, 0, lambda: None, steps=60)
    assert job and straggler == [] and coll == [], (job, straggler, coll)
    assert detector.evaluate(s.table, s.clock.now).firing[0].evidence["phase"] == "data_wait"


def test_a_straggler_a_slow_network_saves_and_restarts_are_no_job_slowdown() -> None:
    # One rank 3x slower: the straggler detector's.
    s = stream()
    s.shape = lambda rank, step: {"forward_backward": 0.6 * 3} if rank == 2 and step > 30 else {}
    job, straggler, _, _ = job_slowdown_run(s, 0, lambda: None, steps=60)
    assert job == [] and straggler, (job, straggler)
    # The network 10x slower, compute flat: the collective slowdown's.
    s = stream()

    def network() -> None:
        s.transfer = 0.2

    job, _, coll, _ = job_slowdown_run(s, 30, network, steps=60)
    assert job == [] and coll, (job, coll)
    # ... and with compute 1.5x slower meanwhile (network-triage beside the training takes CPUs): the reduce grew most.
    s = stream()

    def network_and_busy_cpus() -> None:
        s.transfer, s.compute = 0.2, 0.3

    job, _, _, _ = job_slowdown_run(s, 30, network_and_busy_cpus, steps=60)
    assert job == []
    # A save every 4 steps that stalls its step 2 s: medians over the window's samples do not see it.
    s = stream(shape=lambda rank, step: {"checkpoint": 2.0} if step % 4 == 0 else {})
    job, _, _, _ = job_slowdown_run(s, 0, lambda: None, steps=60)
    assert job == []
    # A new attempt 3x slower from its start (another layout, fewer hosts): its own baseline, learned afresh.
    s = stream()
    s.table.processes.started("job", 0, tuple(s.nodes), s.clock.now)

    def restarted() -> None:
        s.table.processes.started("job", 1, tuple(s.nodes), s.clock.now)
        s.step, s.compute = 0, 0.6

    job, _, _, _ = job_slowdown_run(s, 30, restarted, steps=70)
    assert job == []


def test_job_slowdown_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="clear_factor"):
        JobSlowdown.Config(factor=1.5, clear_factor=1.6)
    with pytest.raises(ValueError, match="window must be >= 2"):
        JobSlowdown.Config(window=1)


# ---- NaN, loss spikes ------------------------------------------------------------------------------------

def test_nonfinite_names_the_first_bad_step_and_ranks_and_clears_after_a_rollback() -> None:
    s = stream(nonfinite_at={12: {0, 1, 2, 3}, 13: {0, 1, 2, 3}})
    detector = NonFinite(NonFinite.Config())
    for _ in range(11):
        s.advance()
        assert detector.evaluate(s.table, s.clock.now).firing == ()
    s.advance()
    assert detector.evaluate(s.table, s.clock.now).firing
    s.advance()
    (f,) = detector.evaluate(s.table, s.clock.now).firing
    assert f.evidence["first_step"] == 12 and f.evidence["last_step"] == 13 and f.evidence["suspect_ranks"] == [0, 1, 2, 3]
    s.step = 8  # rolled back to the checkpoint of step 8, the bad batches skipped
    s.nonfinite_at = {}
    s.advance()
    assert detector.evaluate(s.table, s.clock.now).healthy == {"job"}  # judged afresh from the rollback on
    s.step = 8  # rolled back again, and this time the NaN comes back at step 12: a new finding
    s.nonfinite_at = {12: {1}}
    for _ in range(4):
        s.advance()
        detector.evaluate(s.table, s.clock.now)
    (f,) = detector.evaluate(s.table, s.clock.now).firing
    assert f.evidence["first_step"] == 12 and f.evidence["suspect_ranks"] == [1]


def test_nonfinite_names_the_rank_it_began_on_though_another_hosts_later_step_came_first() -> None:
    # Rank 1 (host n1) turned NaN at step 12; the reduce carried it to every rank at 13, and host n2's batch with it
    # came in before n1's. Within `settle`, n1's first bad step arrives: the finding names step 12 and rank 1.
    s = stream(nonfinite_at={12: {1}, 13: {0, 1, 2, 3}})
    detector = NonFinite(NonFinite.Config(settle=PROGRAM_SETTLE))
    for _ in range(13):
        s.advance()
        assert detector.evaluate(s.table, s.clock.now).firing == ()
    (f,) = detector.evaluate(s.table, s.clock.now + 1).firing
    assert f.evidence["first_step"] == 12 and f.evidence["suspect_ranks"] == [1], f.summary
    # A NaN that passed within `settle` is still reported.
    s = stream(nonfinite_at={12: {2}})
    detector = NonFinite(NonFinite.Config(settle=PROGRAM_SETTLE))
    for _ in range(13):
        s.advance()
        assert detector.evaluate(s.table, s.clock.now).firing == ()
    s.advance()
    (f,) = detector.evaluate(s.table, s.clock.now).firing
    assert f.evidence["first_step"] == 12 and f.evidence["suspect_ranks"] == [2], f.summary


def test_robust_z_ignores_an_outlier_in_the_window() -> None:
    z, med, mad = robust_z(5.0, [3.0, 3.01, 2.99, 3.02, 2.98, 30.0], min_mad=0.001)
    assert med == pytest.approx(3.005) and mad == pytest.approx(0.015) and z > 50


def test_loss_spike_fires_on_the_spike_step_and_not_on_noise() -> None:
    rng = __import__("random").Random(1)
    losses = {step: 4.0 - 0.01 * step + rng.gauss(0, 0.02) for step in range(200)}
    losses[30] = 9.0
    losses[31] = 7.5
    s = stream(loss=lambda step: losses[step])
    detector = LossSpike(LossSpike.Config(window=20, threshold=6.0, clear_after=3))
    fired = {}
    for _ in range(40):
        s.advance()
        for f in detector.evaluate(s.table, s.clock.now).firing:
            fired.setdefault(s.step, f)
    assert min(fired) == 30 and fired[30].evidence["first_step"] == 30 and fired[30].evidence["z"] > 6
    assert max(fired) == 30 + 1 + 3 - 1  # the spike lasts two steps, then three calm ones clear it


# ---- GPU faults ------------------------------------------------------------------------------------------

def test_gpu_fault_fires_per_gpu_on_critical_xid_ecc_remap_and_recovery_action() -> None:
    s = stream()
    healthy = {"gpu": 0, "uuid": "GPU-a", "last_xid": 0, "xid_counts": {}, "ecc_dbe_volatile": 0,
               "row_remap_failure": 0, "row_remap_pending": 0, "recovery_action": 0}
    xid = {"gpu": 1, "uuid": "GPU-b", "last_xid": 79, "xid_counts": {"79": 1, "13": 4}}
    app_xid = {"gpu": 2, "uuid": "GPU-c", "last_xid": 13, "xid_counts": {"13": 2}}  # an application error
    s.send(gpus={"n1": [healthy, xid, app_xid],
                 "n2": [{"gpu": 0, "uuid": "GPU-d", "row_remap_failure": 1, "recovery_action": 2}]})
    detector = GpuFault(GpuFault.Config())
    result = detector.evaluate(s.table, s.clock.now)
    by_key = {f.key: f for f in result.firing}
    assert set(by_key) == {"n1/gpu1", "n2/gpu0"} and result.healthy == {"n1/gpu0", "n1/gpu2"}
    assert by_key["n1/gpu1"].evidence["reasons"] == ["Xid 79 x1"] and by_key["n1/gpu1"].job == "job"
    assert "node reboot" in by_key["n2/gpu0"].summary and "row remapping failed" in by_key["n2/gpu0"].summary


# ---- registry and rules ----------------------------------------------------------------------------------

def test_every_detector_is_registered_and_loads_from_a_rule_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    names = ["crash", "hang", "straggler", "nonfinite", "loss_spike", "gpu_fault", "collective_slowdown", "job_slowdown"]
    assert set(names) <= set(default_registry().names())
    rules = "\n".join(f"- name: r-{n.replace('_', '-')}\n  when: {{detector: {n}}}\n" for n in names)
    rules += "- name: tuned\n  when: {detector: hang, floor: 30s, k: 4}\n"
    (tmp_path / "rules.yaml").write_text(rules)
    loaded = load_rules([tmp_path / "rules.yaml"])
    assert [r.condition.detector for r in loaded][:len(names)] == names  # type: ignore[union-attr]
    assert loaded[-1].condition.params.floor == timedelta(seconds=30)  # type: ignore[union-attr]
    (tmp_path / "bad.yaml").write_text("- name: bad\n  when: {detector: straggler, windw: 3}\n")
    with pytest.raises(Exception, match="windw"):
        load_rules([tmp_path / "bad.yaml"])


def test_hang_leaves_a_job_alone_once_its_ranks_say_they_are_finishing() -> None:
    s = stream()
    detector = Hang(Hang.Config(floor=timedelta(seconds=5)))
    s.advance()
    detector.evaluate(s.table, s.clock.now)
    batch = {"schema": 1, "node": "n1", "seq": 99, "sent_at": 0.0, "ranks": [
        {"job": "job", "rank": 0, "pid": 1000, "alive": True, "last_seen_age_s": 0.1, "step": s.step,
         "last_event": {"name": "finishing", "time": 0.0, "fields": {"step": s.step + 1, "reason": "done"}}}]}
    s.table.ingest(batch)
    s.clock.now += 60
    assert detector.evaluate(s.table, s.clock.now).firing == ()
    batch["ranks"][0]["last_event"]["fields"]["step"] = s.step - 3  # an old attempt's event: does not count
    s.table.ingest(batch)
    assert detector.evaluate(s.table, s.clock.now).firing != ()


def test_straggler_compares_ranks_within_a_pipeline_stage() -> None:
    # pp2 x dp2: stage 1 (ranks 2, 3) does more work than stage 0, and stage 0 waits for it inside its
    # forward/backward; rank 2 is the slow one within its stage.
    def shape(rank: int, step: int) -> dict[str, float]:
        work = {0: 0.30, 1: 0.30, 2: 0.70, 3: 0.40}  # rank 0/1 include waiting for stage 1's gradients
        return {"forward_backward": work[rank]}

    s = stream(shape=shape, mesh=lambda rank, world: {"pp": 0 if rank < 2 else 1, "dp": rank % 2, "tp": 0})
    detector = Straggler(Straggler.Config(window=4, consecutive=2))
    for _ in range(16):
        s.advance()
        detector.evaluate(s.table, s.clock.now)
    (f,) = detector.evaluate(s.table, s.clock.now).firing
    assert f.evidence["suspect_rank"] == 2 and {r["stage"] for r in f.evidence["phase_table"]} == {0, 1}


def test_straggler_names_the_slow_stage_s_rank_not_its_pipeline_partner_that_reaches_the_reduce_late() -> None:
    # The demo's job (pp2 x dp2) with rank 2 stopped 85% of the time, as its ranks recorded it (medians of steps
    # 3-15, tests/distributed/test_pipeline_waits.py's run): rank 0 waits for rank 2 in pp_wait (0.53 s, not in
    # its compute) and so reaches its own reduce late, where rank 1 waits 0.35 s for it; rank 2 computes 6x slower
    # than rank 3, which waits for it in the reduce. Stage 0 alone would name rank 0, late into the reduce.
    compute = [0.0685, 0.0652, 0.4108, 0.0700]
    reduce = [0.0068, 0.3484, 0.0117, 0.5111]
    table = PhaseTable(rank=np.arange(4), node=np.array([0, 0, 1, 1]), node_names=["n1", "n2"],
                       stage=np.array([0, 0, 1, 1]), samples=np.full(4, 5), step_s=np.full(4, 0.625),
                       compute_s=np.array(compute), data_wait_s=np.zeros(4), dp_reduce_s=np.array(reduce),
                       reduce_lag_s=np.full(4, np.nan))
    assert attribute(table, np.array([0, 1]), 1.3, 0.2).cause == "late-reduce"
    found = attribute_by_stage(table, 1.3, 0.2)
    assert (found.rank, found.cause) == (2, "compute") and found.strength == pytest.approx(0.4108 / 0.0700)
    # With the stages the other way round (the slow rank in stage 0), the same rank is named.
    flipped = replace(table, stage=np.array([1, 1, 0, 0]))
    assert attribute_by_stage(flipped, 1.3, 0.2).rank == 2
    # A milder slowdown (1.5x) in longer steps: the late reduce is the larger number in seconds, the compute the
    # cause (a ranking by the findings' largest detail, seconds against a ratio, named rank 0 here).
    milder = replace(table, step_s=np.full(4, 1.6), compute_s=np.array([0.5, 0.5, 0.75, 0.5]),
                     dp_reduce_s=np.array([0.02, 0.9, 0.02, 0.55]))
    assert attribute(milder, np.array([0, 1]), 1.3, 0.2).rank == 0
    assert attribute_by_stage(milder, 1.3, 0.2).rank == 2


def test_a_new_attempt_of_a_job_starts_every_learning_detector_afresh() -> None:
    # Rank 3 is slow; two windows have named it when the job is restarted (attempt 1: other processes, perhaps
    # on another host). What the old attempt showed is no evidence against the new one: the new attempt needs
    # its own three windows in a row.
    s = stream(shape=lambda rank, step: {"forward_backward": 0.4} if rank == 3 else {})
    s.table.processes.started("job", 0)
    detector = Straggler(Straggler.Config(window=5, consecutive=3))
    while s.step < 12:  # windows closing at steps 6 and 11 named rank 3: a streak of two
        s.advance()
        assert not detector.evaluate(s.table, s.clock.now).firing
    s.table.processes.started("job", 1)
    restarted_at = s.step
    fired_at = None
    while fired_at is None and s.step < 60:
        s.advance()
        if detector.evaluate(s.table, s.clock.now).firing:
            fired_at = s.step
    assert fired_at is not None and fired_at >= restarted_at + 3 * 5, (restarted_at, fired_at)


def test_a_step_that_says_its_attempt_counts_whatever_its_hosts_clock_says() -> None:
    # The ranks' hosts run 5 minutes behind the healer: by their own time every step ended before the attempt
    # started. Steps that say their attempt count (a NaN at step 6 is found); untold, they would be taken for
    # the attempt before's.
    for attempt, found in ((0, True), (None, False)):
        s = stream(clock_skew=-300.0, attempt=attempt)
        s.table.processes.started("job", 0, tuple(s.nodes), s.clock.now)
        detector = NonFinite(NonFinite.Config())
        s.nonfinite_at[6] = {1}
        for _ in range(6):
            s.advance()
        assert bool(detector.evaluate(s.table, s.clock.now).firing) == found, attempt


# ---- host_lost -------------------------------------------------------------------------------------------

def _placed(s: JobStream) -> None:
    s.table.processes.started("job", 0, tuple(s.nodes), s.clock.now)


def test_host_lost_names_a_host_that_went_silent_when_the_job_stopped_with_it() -> None:
    s = stream()
    _placed(s)
    detector = HostLost(HostLost.Config(after=timedelta(seconds=10)))
    for _ in range(5):
        s.advance()
        assert not detector.evaluate(s.table, s.clock.now).firing
    assert detector.evaluate(s.table, s.clock.now).healthy == {"job/n1", "job/n2"}
    s.silent = {"n2"}
    step = s.step
    fired_after = None
    for t in range(1, 20):  # n1 still reports, but no rank steps: the job waits for the ranks of n2
        s.clock.now += 1.0
        s.send()
        if detector.evaluate(s.table, s.clock.now).firing and fired_after is None:
            fired_after = t
    assert s.step == step and fired_after == 11  # silent for more than 10 s
    (f,) = detector.evaluate(s.table, s.clock.now).firing
    assert (f.key, f.node, f.evidence["suspect_node"]) == ("job/n2", "n2", "n2")
    assert f.evidence["job_step"] == step and f.evidence["no_step_for_s"] > 5
    assert "n1" in f.evidence["other_hosts_heard_age_s"]
    # The restart leaves n2 out: the incident's host is no longer the job's.
    s.table.processes.started("job", 1, ("n1", "n3"), s.clock.now)
    assert "job/n2" in detector.evaluate(s.table, s.clock.now).healthy


def test_host_lost_leaves_a_host_alone_whose_reports_stopped_while_the_job_trains_on() -> None:
    # Only its agent is gone (killed, restarting): its ranks still train with the others.
    s = stream()
    _placed(s)
    detector = HostLost(HostLost.Config(after=timedelta(seconds=5)))
    s.advance()
    s.silent = {"n2"}
    for _ in range(30):
        s.advance()
        assert not detector.evaluate(s.table, s.clock.now).firing


def test_host_lost_does_not_fire_for_a_link_that_comes_back_within_after() -> None:
    s = stream()
    _placed(s)
    detector = HostLost(HostLost.Config(after=timedelta(seconds=10)))
    s.advance()
    s.silent = {"n2"}
    for _ in range(8):  # a flap: 8 s without n2 and without a step
        s.clock.now += 1.0
        s.send()
        assert not detector.evaluate(s.table, s.clock.now).firing
    s.silent = set()
    for _ in range(20):
        s.advance()
        assert not detector.evaluate(s.table, s.clock.now).firing


def test_host_lost_names_a_host_that_never_reported_and_ignores_a_job_being_stopped() -> None:
    s = stream()
    s.silent = {"n2"}
    _placed(s)
    detector = HostLost(HostLost.Config(after=timedelta(seconds=5)))
    for _ in range(7):
        s.clock.now += 1.0
        s.send()
    (f,) = detector.evaluate(s.table, s.clock.now).firing
    assert f.node == "n2" and f.evidence["last_heard_age_s"] is None and "since the attempt started" in f.summary
    s.table.processes.stopping("job")
    assert not detector.evaluate(s.table, s.clock.now).firing


def test_a_crash_of_peer_echoes_waits_for_the_silent_host_and_then_names_it() -> None:
    s = stream()
    _placed(s)
    view = s.table.processes
    s.advance()
    s.silent = {"n2"}  # n2 died with its ranks: their exits are never reported
    for rank in (0, 1):
        view.record_exit(ProcessExit(job="job", attempt=0, node="n1", rank=rank, pid=1000 + rank,
                                     at=s.clock.now + 1, exit_code=1, log_tail=tuple(GLOO_PEER)))
    crash = Crash(Crash.Config(silent_host_hold=timedelta(seconds=30)))
    for _ in range(20):
        s.clock.now += 1.0
        s.send()
        assert not crash.evaluate(s.table, s.clock.now).firing  # host_lost names the host first
    for _ in range(12):  # past the hold (nothing else named the host): the crash fires, naming it
        s.clock.now += 1.0
        s.send()
    (f,) = crash.evaluate(s.table, s.clock.now).firing
    assert (f.node, f.evidence["suspect_node"], f.evidence["silent_hosts"]) == ("n2", "n2", ["n2"])
    assert "lost with their host" in f.summary


def _running(s: JobStream) -> None:
    """The attempt's ranks as the agents see them: every one alive, waiting (S)."""
    s.table.processes.update_states([
        ProcessState(job="job", attempt=0, node=n, rank=r, pid=1000 + r, state="S", cpu_seconds=1.0,
                     sampled_at=s.clock.now) for n, rs in NODES.items() for r in rs])


def test_a_stall_while_a_host_is_silent_is_left_to_host_lost_and_is_a_hang_only_past_the_hold() -> None:
    s = stream()
    _placed(s)
    _running(s)
    hang = Hang(Hang.Config(floor=timedelta(seconds=5), silent_host_hold=timedelta(seconds=20)))
    for _ in range(5):
        s.advance()
        hang.evaluate(s.table, s.clock.now)
    s.silent = {"n2"}  # n2 died: n1's ranks wait for it in a collective, n1's agent goes on reporting
    fired_after = None
    for t in range(1, 30):
        s.clock.now += 1.0
        s.send()
        if hang.evaluate(s.table, s.clock.now).firing and fired_after is None:
            fired_after = t
    assert fired_after == 21, "held while n2 was silent for up to 20 s, not at the 5 s floor"


def test_a_stall_with_every_host_reporting_is_a_hang_at_its_timeout() -> None:
    s = stream()
    _placed(s)
    _running(s)
    hang = Hang(Hang.Config(floor=timedelta(seconds=5)))
    for _ in range(5):
        s.advance()
        hang.evaluate(s.table, s.clock.now)
    fired_after = None
    for t in range(1, 10):  # every agent reports, no rank steps
        s.clock.now += 1.0
        s.send()
        if hang.evaluate(s.table, s.clock.now).firing and fired_after is None:
            fired_after = t
    assert fired_after == 6


def test_the_stall_after_a_rank_died_is_the_crash_s_not_a_hang_while_the_crash_waits_for_how_it_died() -> None:
    # As in CI under load: torchrun reaped the SIGKILLed rank 3 first (its status unknown), and stopping its host's
    # other rank took longer than the hang's floor. The crash waits for torchrun's report; no hang opens meanwhile.
    s = stream()
    _placed(s)
    _running(s)
    hang, crash = Hang(Hang.Config(floor=timedelta(seconds=5))), Crash(Crash.Config())
    for _ in range(5):
        s.advance()
        hang.evaluate(s.table, s.clock.now)
    died_at = s.clock.now
    s.table.processes.report("n2", AttemptReport(job="job", attempt=0, node_rank=1, exits=[
        RankExit(rank=3, pid=1003, at=died_at, vanished=True)]), died_at)
    for _ in range(20):  # 20 s of every host reporting, no rank stepping, the crash still waiting
        s.clock.now += 1.0
        s.send()
        assert not hang.evaluate(s.table, s.clock.now).firing
        assert not crash.evaluate(s.table, s.clock.now).firing
    s.table.processes.report("n2", AttemptReport(job="job", attempt=0, node_rank=1, exits=[
        RankExit(rank=3, pid=1003, at=died_at, signal=signal.SIGKILL)], ended=True, exit_code=1), s.clock.now)
    (f,) = crash.evaluate(s.table, s.clock.now).firing
    assert f.summary.startswith("rank 3 on n2 killed by SIGKILL")
    assert not hang.evaluate(s.table, s.clock.now).firing


def test_a_crash_that_says_what_it_is_fires_at_once_even_with_a_silent_host() -> None:
    s = stream()
    _placed(s)
    s.advance()
    s.silent = {"n2"}
    s.clock.now += 5.0
    s.table.processes.record_exit(ProcessExit(job="job", attempt=0, node="n1", rank=0, pid=1000, at=s.clock.now,
                                              exit_code=1, log_tail=tuple(TRACEBACK)))
    (f,) = Crash(Crash.Config()).evaluate(s.table, s.clock.now).firing
    assert f.evidence["suspect_rank"] == 0 and f.evidence["class"]["category"] == "oom"


def _rank_3_vanished_on_n2() -> HeartbeatTable:
    """Attempt 0 on n1 and n2; at t=10 n2's agent found rank 3 gone without its exit status (torchrun reaped it)."""
    table = HeartbeatTable(clock=ManualClock())
    table.processes.started("job", 0, ("n1", "n2"), 0.0)
    vanished = RankExit(rank=3, pid=1003, at=10.0, vanished=True)
    table.processes.report("n2", AttemptReport(job="job", attempt=0, node_rank=1, exits=[vanished]), 10.0)
    return table


def test_a_rank_that_vanished_waits_for_its_hosts_report_of_how_it_died() -> None:
    # torchrun reaped rank 3 before its status could be read; its failure report (in its host's report once torchrun
    # has exited) says SIGKILL. However long that takes on a loaded machine, the crash waits for it.
    table = _rank_3_vanished_on_n2()
    view = table.processes
    crash = Crash(Crash.Config())
    assert not crash.evaluate(table, 25.0).firing  # 15 s later: still waiting for the report
    died = RankExit(rank=3, pid=1003, at=10.0, signal=signal.SIGKILL)
    view.report("n2", AttemptReport(job="job", attempt=0, node_rank=1, exits=[died], ended=True, exit_code=1), 26.0)
    (f,) = crash.evaluate(table, 26.0).firing
    assert f.evidence["signal"] == "SIGKILL" and f.summary.startswith("rank 3 on n2 killed by SIGKILL")


@pytest.mark.parametrize("skew", [-300.0, 300.0])
def test_a_crash_is_timed_by_the_healers_clock_whatever_the_agents_host_says(skew: float) -> None:
    # n2's clock is 5 minutes off the healer's. Its report of rank 3's SIGKILL (at its own time) reaches the healer
    # at t=10: a settle of 5 s ends at t=15 either way (a clock ahead once held the crash for 5 minutes more; one
    # behind skipped the settle), and a vanished rank waits report_wait (30 s) from t=10 for its host's report.
    table = HeartbeatTable(clock=ManualClock())
    table.processes.started("job", 0, ("n1", "n2"), 0.0)
    died = RankExit(rank=3, pid=1003, at=10.0 + skew, signal=signal.SIGKILL)
    table.processes.report("n2", AttemptReport(job="job", attempt=0, node_rank=1, exits=[died]), 10.0)
    settled = Crash(Crash.Config(settle=timedelta(seconds=5)))
    assert not settled.evaluate(table, 14.0).firing
    assert settled.evaluate(table, 15.5).firing
    gone = HeartbeatTable(clock=ManualClock())
    gone.processes.started("job", 0, ("n1", "n2"), 0.0)
    vanished = RankExit(rank=3, pid=1003, at=10.0 + skew, vanished=True)
    gone.processes.report("n2", AttemptReport(job="job", attempt=0, node_rank=1, exits=[vanished]), 10.0)
    crash = Crash(Crash.Config())
    assert not crash.evaluate(gone, 39.0).firing and crash.evaluate(gone, 40.5).firing


def test_a_vanished_rank_seen_at_the_same_moment_as_a_peer_with_its_status_still_waits_for_the_report() -> None:
    # As in CI: n2's agent found rank 2 a zombie (SIGTERM, torchrun stopping it) and rank 3 already reaped, in one
    # look. The peer sorts first; the crash must still wait to learn how rank 3 died.
    table = HeartbeatTable(clock=ManualClock())
    view = table.processes
    view.started("job", 0, ("n1", "n2"), 0.0)
    echo = RankExit(rank=2, pid=1002, at=10.0, signal=signal.SIGTERM,
                    log_tail=["RuntimeError: [gloo] Connection closed by peer"])
    gone = RankExit(rank=3, pid=1003, at=10.0, vanished=True)
    view.report("n2", AttemptReport(job="job", attempt=0, node_rank=1, exits=[echo, gone]), 10.0)
    crash = Crash(Crash.Config())
    assert not crash.evaluate(table, 12.0).firing
    died = RankExit(rank=3, pid=1003, at=12.5, signal=signal.SIGKILL)
    view.report("n2", AttemptReport(job="job", attempt=0, node_rank=1, exits=[echo, died], ended=True, exit_code=1),
                12.5)
    (f,) = crash.evaluate(table, 13.0).firing
    assert f.summary.startswith("rank 3 on n2 killed by SIGKILL"), f.summary


def test_a_peer_that_torchrun_ended_with_sigterm_is_an_echo_even_with_nothing_in_its_log() -> None:
    # A user's script does not catch SIGTERM: torchrun stopping rank 2 after rank 3 was SIGKILLed (and reaped by
    # torchrun first) left no line in rank 2's log. Rank 2's status came first; rank 3's, in the report, later.
    table = HeartbeatTable(clock=ManualClock())
    view = table.processes
    view.started("job", 0, ("n1", "n2"), 0.0)
    echo = RankExit(rank=2, pid=1002, at=10.0, signal=signal.SIGTERM)
    died = RankExit(rank=3, pid=1003, at=12.5, signal=signal.SIGKILL)
    view.report("n2", AttemptReport(job="job", attempt=0, node_rank=1, exits=[echo, died], ended=True, exit_code=1),
                12.5)
    (f,) = Crash(Crash.Config()).evaluate(table, 16.0).firing
    assert f.summary.startswith("rank 3 on n2 killed by SIGKILL"), f.summary


def test_a_rank_that_vanished_on_a_host_whose_part_exited_0_finished_and_is_no_crash() -> None:
    # The job's last step done: torchrun reaped rank 3 before its agent read its status, and its last heartbeat (the
    # one saying it was finishing) never reached the healer. torchrun exits 0 only when every worker did.
    table = _rank_3_vanished_on_n2()
    view = table.processes
    gone = RankExit(rank=3, pid=1003, at=10.0, vanished=True)
    view.report("n2", AttemptReport(job="job", attempt=0, node_rank=1, exits=[gone], ended=True, exit_code=0), 11.0)
    crash = Crash(Crash.Config())
    for now in (11.0, 20.0, 60.0):
        assert not crash.evaluate(table, now).firing


def test_a_vanished_rank_whose_host_never_reports_fires_after_report_wait() -> None:
    table = HeartbeatTable(clock=ManualClock())
    table.processes.started("job", 0, ("n1",), 0.0)
    table.processes.report("n1", AttemptReport(job="job", attempt=0, node_rank=0,
                                               exits=[RankExit(rank=0, pid=1000, at=1.0, vanished=True)]), 1.0)
    crash = Crash(Crash.Config(report_wait=timedelta(seconds=30)))
    assert not crash.evaluate(table, 30.0).firing
    (f,) = crash.evaluate(table, 31.5).firing
    assert f.evidence["vanished"] is True and "vanished" in f.summary
