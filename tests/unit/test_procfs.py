"""ground.procfs: real processes this test starts, stops, turns into zombies and reaps, and fixture /proc files
(tests/fixtures/proc) for what a live machine will not show on demand: exit statuses of other kinds, a kernel
without field 52, command names that look like the rest of the line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ground import procfs
from tests.support import wait_for

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "proc"


def state(pid: int) -> str | None:
    st = procfs.stat(pid)
    return None if st is None else st.state


@pytest.fixture
def stopped_child():
    """A shell that stops itself at once and exits with status 3 once continued; its environment says RANK=5."""
    child = subprocess.Popen(["/bin/sh", "-c", "kill -STOP $$; exit 3", "procfs-test"], env=dict(os.environ, RANK="5"))
    try:
        wait_for("the child to stop itself", lambda: state(child.pid) == "T", timeout_s=20, every_s=0.02)
        yield child
    finally:
        child.kill()
        child.wait()


# ---- real processes -------------------------------------------------------------------------------------------


def test_it_reads_a_stopped_process_as_alive_with_its_arguments_rank_and_start(stopped_child) -> None:
    pid = stopped_child.pid
    st = procfs.stat(pid)
    assert st is not None and st.comm == "sh" and st.wait_status is None and st.exit_code is None
    assert procfs.alive(pid), "stopped is not dead: SIGCONT brings it back"
    assert procfs.cmdline(pid) == ["/bin/sh", "-c", "kill -STOP $$; exit 3", "procfs-test"]
    assert procfs.environ(pid)["RANK"] == "5" and procfs.worker_rank(pid) == 5
    assert pid in procfs.children(os.getpid()) and pid in procfs.descendants(os.getpid())
    assert procfs.start_time(pid) == st.started and procfs.is_same_process(pid, st.started)
    assert not procfs.is_same_process(pid, st.started + 1 / procfs.CLOCK_TICKS), "a later process under this pid"
    own = procfs.stat(os.getpid())
    assert own is not None and own.started <= st.started and own.cpu_seconds > 0


def test_it_reads_a_zombies_exit_code_and_forgets_everything_once_it_is_reaped(stopped_child) -> None:
    pid = stopped_child.pid
    started = procfs.start_time(pid)
    os.kill(pid, signal.SIGCONT)
    wait_for("the child to exit", lambda: state(pid) == "Z", timeout_s=20, every_s=0.02)
    st = procfs.stat(pid)
    assert st is not None and st.exit_code == 3 and st.signal is None
    assert not procfs.alive(pid), "a zombie has left, whoever reaps it"
    assert procfs.cmdline(pid) == [] and procfs.environ(pid) == {} and procfs.worker_rank(pid) is None
    assert pid in procfs.children(os.getpid()), "listed until its parent reaps it"
    assert started is not None and procfs.is_same_process(pid, started), "still the same (dead) process"
    assert stopped_child.wait(timeout=10) == 3
    assert procfs.stat(pid) is None and not procfs.alive(pid) and procfs.start_time(pid) is None
    assert not procfs.is_same_process(pid, started)
    assert procfs.cmdline(pid) == [] and procfs.environ(pid) == {} and procfs.rss_bytes(pid) is None
    assert pid not in procfs.children(os.getpid()) and procfs.children(pid) == [] and procfs.descendants(pid) == []
    assert procfs.open_files(pid) == [] and procfs.peak_rss_bytes(pid) is None


def test_it_reads_the_signal_that_killed_a_stopped_process(stopped_child) -> None:
    os.kill(stopped_child.pid, signal.SIGKILL)
    wait_for("the child to die", lambda: state(stopped_child.pid) == "Z", timeout_s=20, every_s=0.02)
    st = procfs.stat(stopped_child.pid)
    assert st is not None and st.signal == signal.SIGKILL and st.exit_code is None


def test_it_finds_descendants_in_sessions_of_their_own() -> None:
    # As torchrun does with its workers: the grandchild leaves the child's session and process group.
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                              "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
                              "print(p.pid, flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())  # type: ignore[union-attr]
        found = procfs.children(child.pid), procfs.children(os.getpid()), procfs.descendants(os.getpid())
        os.kill(grandchild, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert found[0] == [grandchild] and child.pid in found[1] and grandchild not in found[1]
    assert {child.pid, grandchild} <= set(found[2])


def test_it_lists_what_a_process_holds_open_and_its_memory(tmp_path: Path) -> None:
    with open(tmp_path / "held", "wb"):
        assert str(tmp_path / "held") in procfs.open_files(os.getpid())  # type: ignore[operator]
    assert os.getpid() in procfs.pids()
    rss, peak = procfs.rss_bytes(os.getpid()), procfs.peak_rss_bytes(os.getpid())
    assert rss is not None and peak is not None and 0 < rss <= peak


# ---- fixture files: /proc/PID/stat as other kernels and other deaths write it ------------------------------------


@pytest.mark.parametrize(("pid", "exit_code", "sig"), [(4301, 1, None), (4302, None, signal.SIGKILL)])
def test_it_reads_how_a_zombie_died_from_stat_field_52(pid: int, exit_code: int | None, sig: int | None) -> None:
    st = procfs.stat(pid, FIXTURES)
    assert st is not None and st.state == "Z" and (st.exit_code, st.signal) == (exit_code, sig)
    assert not procfs.alive(pid, FIXTURES)


def test_it_is_not_fooled_by_a_command_name_that_looks_like_the_rest_of_the_line() -> None:
    st = procfs.stat(4302, FIXTURES)
    assert st is not None and st.comm == "a) R 1 (b" and st.state == "Z"
    odd = procfs.stat(4305, FIXTURES)  # not UTF-8: read, not raised on
    assert odd is not None and odd.comm == "rank\ufffd" and odd.state == "D" and procfs.alive(4305, FIXTURES)


def test_it_reads_cpu_time_and_start_and_no_exit_status_of_a_running_process() -> None:
    st = procfs.stat(4303, FIXTURES)
    assert st is not None and st.state == "R" and st.wait_status is None
    assert st.cpu_seconds == pytest.approx((1234 + 567) / procfs.CLOCK_TICKS)
    assert st.started == 72900 / procfs.CLOCK_TICKS == procfs.start_time(4303, FIXTURES)
    assert procfs.is_same_process(4303, st.started, FIXTURES)
    assert not procfs.is_same_process(4303, 72848 / procfs.CLOCK_TICKS, FIXTURES)
    assert procfs.peak_rss_bytes(4303, FIXTURES) == 2 * 2**30


def test_it_reads_a_zombie_of_a_kernel_without_field_52_as_dead_with_its_status_unknown() -> None:
    st = procfs.stat(4304, FIXTURES)
    assert st is not None and st.state == "Z" and st.wait_status is None and st.exit_code is None and st.signal is None
    assert not procfs.alive(4304, FIXTURES)


def test_it_answers_gone_for_a_pid_without_a_proc_entry() -> None:
    assert procfs.pids(FIXTURES) == [4301, 4302, 4303, 4304, 4305]
    assert procfs.stat(4299, FIXTURES) is None and not procfs.alive(4299, FIXTURES)
    assert procfs.start_time(4299, FIXTURES) is None and not procfs.is_same_process(4299, 0.0, FIXTURES)
    assert procfs.open_files(4299, FIXTURES) == [] and procfs.peak_rss_bytes(4299, FIXTURES) is None
