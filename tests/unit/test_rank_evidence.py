"""What the node agent reads of a rank from outside it, on real processes: a rank spinning in compute (state R),
one blocked in a read(2) (S, in the kernel's pipe read) with its phase-now beacon, one stopped (T); its Python
stack from py-spy without pausing it; and a process that is gone."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ground import procfs
from healer.agent import rank_evidence
from tests.support import wait_for

pytestmark = pytest.mark.unit

SPIN = """
def spin_here():
    x = 0
    while True:
        x = (x * 31 + 7) % 1000003
spin_here()
"""
READ = """
import os, sys
sys.path.insert(0, {repo!r})
from wire.phase_now import PhaseBeacon
beacon = PhaseBeacon({phase_dir!r}, rank=5)
beacon.enter("checkpoint", 11)
def read_forever():
    r, _w = os.pipe()
    os.read(r, 1)
read_forever()
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait(10)


def _python(code: str, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)])
    procs.append(p)
    return p


@pytest.mark.timeout(60)
def test_a_spinning_rank_a_rank_blocked_in_a_read_and_a_stopped_one_are_told_apart_from_outside(
        tmp_path: Path, procs) -> None:
    repo = str(Path(__file__).resolve().parents[2])
    spin = _python(SPIN, procs)
    reader = _python(READ.format(repo=repo, phase_dir=str(tmp_path)), procs)
    stopped = _python(SPIN, procs)
    # NOTE: the kernel function's name varies by version (pipe_read; anon_pipe_read on 6.18).
    wait_for("the reader in its read", lambda: "pipe_read" in (procfs.wchan(reader.pid) or ""), 30)
    time.sleep(0.5)  # the spinners into their loop
    stopped.send_signal(signal.SIGSTOP)
    wait_for("the stopped one stopped", lambda: (procfs.stat(stopped.pid) or procfs.stat(1)).state == "T", 10)

    ev = rank_evidence.collect(spin.pid, 0, tmp_path)
    assert ev.state == "R" and ev.wchan is None and ev.phase is None and ev.error is None
    assert ev.stack and ev.stack[0].function == "spin_here"

    ev = rank_evidence.collect(reader.pid, None, tmp_path)
    assert ev.state == "S" and "pipe_read" in (ev.wchan or "") and ev.rank == 5, "the rank from its beacon"
    assert ev.phase is not None and (ev.phase.phase, ev.phase.step) == ("checkpoint", 11)
    assert [f.function for f in ev.stack[:1]] == ["read_forever"]
    payload = ev.to_payload(time.time_ns())
    assert payload["phase"]["for_s"] > 0 and payload["stack"][0].startswith("read_forever (")

    ev = rank_evidence.collect(stopped.pid, 2, None)
    assert ev.state == "T" and ev.stack and ev.stack[0].function == "spin_here", "read without resuming it"
    assert (procfs.stat(stopped.pid) or procfs.stat(1)).state == "T", "still stopped: py-spy did not pause or resume it"
    # Its flight recorder thread is stopped with it: not waited for (the deadline is 30 s), and not asked any more.
    (found,), took = rank_evidence.collect_all({stopped.pid: 2}, tmp_path, recorder_wait_s=30)
    assert found["state"] == "T" and found["collectives"] is None and took < 15
    assert not (tmp_path / f"{stopped.pid}.fr-request").exists()


def test_a_process_that_is_gone_or_a_dump_that_fails_still_gives_what_can_be_read(tmp_path: Path, procs) -> None:
    gone = _python("pass", procs)
    gone.wait(10)
    ev = rank_evidence.collect(gone.pid, 1, tmp_path)
    assert ev.state is None and ev.stack == [] and ev.error == "the process is gone"
    with pytest.raises(rank_evidence.StackUnavailable, match="no JSON"):
        rank_evidence.parse_dump("Error: not a python process")
    with pytest.raises(rank_evidence.StackUnavailable, match="no Python thread"):
        rank_evidence.parse_dump("[]")
