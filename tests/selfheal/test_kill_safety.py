"""Every signal the healer sends is checked first: a pid the kernel has given to another process since the rank
died (after a backoff of minutes, or a healer that died) is never signalled, even one that carries the attempt's
run id. Real processes: a pid really reused inside a PID namespace of our own, and a process whose start time is
not the one the journal recorded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ground import kill, procfs
from healer.launchers.coordinator import Coordinator
from healer.observe.processes import ProcessView
from tests.conftest import REPO

pytestmark = pytest.mark.unit

SLEEP = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]


def _started(argv: list[str], **kw: object) -> subprocess.Popen[str]:
    """`argv` started and past its exec. NOTE: Popen returns once the exec is past its point of no return, before
    the kernel has set up the new program's argument and environment pages: until then /proc/PID/environ reads
    empty, and a run-id check fails (it did once in CI, under load)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **kw)  # type: ignore[call-overload]
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    return proc
UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _namespaces_work(), reason="no user and PID namespaces here (unshare refused)")
def test_it_never_signals_a_ranks_pid_once_another_process_has_it(tmp_path: Path) -> None:
    out = subprocess.run([*UNSHARE, sys.executable, "-m", "tests.selfheal.pid_reuse", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result["reused"]:
        pytest.skip("the kernel did not hand the dead rank's pid to the decoy")
    assert result == {"reused": True, "alive_after_stop": True, "kill_rank": "refused",
                      "alive_after_kill_rank": True}, out.stderr[-3000:]


def test_it_refuses_a_process_whose_start_time_is_not_the_one_recorded(tmp_path: Path) -> None:
    # A stand-in for the process that got a dead rank's pid: it even carries the attempt's run id.
    other = _started(SLEEP, env=dict(os.environ, RANK="1", TORCHELASTIC_RUN_ID="j-1"))
    try:
        started = procfs.start_time(other.pid)
        assert started is not None
        rank_then = kill.Target(other.pid, started - 7.0, "j-1")  # the rank that had this pid, long gone
        assert not kill.send(rank_then, signal.SIGKILL)
        assert not kill.send(kill.Target(other.pid, started, "j-2"), signal.SIGKILL)  # another attempt's run id
        assert kill.identify(other.pid, "j-1", started - 7.0) is None
        # A healer taking over a run whose journal recorded that rank: it kills nothing that is not that rank.
        journal = tmp_path / "supervisor" / "attempts.jsonl"
        journal.parent.mkdir()
        journal.write_text("\n".join(json.dumps(e) for e in [
            {"event": "start", "attempt": 1, "at": 3.0, "nodes": ["n1"], "dp": 1, "agents": {}, "agents_started": {}},
            {"event": "ranks", "attempt": 1, "at": 4.0, "ranks": {str(other.pid): 1},
             "started": {str(other.pid): started - 7.0}},
        ]) + "\n")
        token = "t" * 16
        coordinator = Coordinator(Coordinator.Config(job="j", config="configs/demo.yaml", run_dir=tmp_path,
                                                     hosts_are_local=True), ProcessView(), token, epoch=1)
        assert coordinator.take_over(token) == (False, ())  # n1 has no agent: its processes are looked for here
        assert other.poll() is None, "a process that only has a dead rank's pid was killed"
        # The process itself, as recorded, is the one a signal reaches.
        assert kill.send(kill.Target(other.pid, started, "j-1"), signal.SIGKILL)
        assert other.wait(timeout=10) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()


@pytest.mark.timeout(20)  # NOTE: below wait_gone's 30 s: waiting it out fails the test
def test_a_rank_stuck_in_the_kernel_after_sigkill_is_given_up_on_early_not_waited_out(tmp_path: Path) -> None:
    from testbed import freezer
    from testbed.layout import FREEZER_ROOT

    rank = subprocess.Popen(SLEEP)
    root = FREEZER_ROOT / f"mh-waitgone-{rank.pid}"
    try:
        freezer.freeze(root, [rank.pid], "rank")
        target = kill.identify(rank.pid, None)
        assert target is not None and kill.send(target, signal.SIGKILL)
        left = kill.wait_gone([target], timeout_s=30, stuck_s=1.0)
        assert [t.pid for t in left] == [rank.pid], "still there: the SIGKILL waits for the thaw"
        assert (procfs.stat(rank.pid) or procfs.stat(1)).state == "D"
    finally:
        freezer.remove_all(root)
        rank.wait(10)
    assert rank.returncode == -signal.SIGKILL
