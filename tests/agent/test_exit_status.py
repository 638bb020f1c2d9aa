"""A rank's exit status, read by the node agent's look before torchrun reaps the rank. torchrun looks at its workers
every 0.2 s and reaps a dead one at once; only the zombie holds its status for anyone else, and torchrun's own failure
report comes only after it has stopped the host's other ranks. The parent here reaps as torchrun does and never
reports: every status the test sees was read from the zombie.

The parent is held (SIGSTOP) while its rank dies, so that the zombie is there for the agent's look however loaded the
machine is (a fresh make test, two workers on two cores, once found it reaped already: a race the agent can lose, and
then torchrun's report says how the rank died). What the test holds the agent to is that it looks at once: its wait
is woken by the rank's pidfd, long before the wait's 30 s.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from healer.agent.host import HostAttempt
from wire.run_ids import run_id

pytestmark = pytest.mark.services

TORCHRUN_LIKE = """
import os, subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                          env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
while True:
    time.sleep(0.2)
    for r in ranks:
        r.poll()  # reaps a dead one, as torchrun's monitor does
"""


def test_a_killed_rank_is_read_from_its_zombie_before_a_torchrun_like_parent_reaps_it(tmp_path: Path) -> None:
    env = {**os.environ, "TORCHELASTIC_RUN_ID": run_id("j", 0)}
    for trial, how in enumerate((signal.SIGKILL, signal.SIGSEGV)):
        attempt = HostAttempt(job="j", attempt=0, node_rank=0, argv=[sys.executable, "-c", TORCHRUN_LIKE], env=env,
                              cwd=tmp_path, log_dir=tmp_path / f"logs-{trial}")
        attempt.start()
        try:
            deadline = time.monotonic() + 30
            while len(attempt.ranks) < 2 and time.monotonic() < deadline:
                attempt.wait_for_exit(0.2)
                attempt.poll()
            assert len(attempt.ranks) == 2, "the ranks were not found under their parent"
            assert attempt.process is not None
            parent = attempt.process.pid
            os.kill(parent, signal.SIGSTOP)
            try:
                attempt.signal(1, how)
                waited = time.monotonic()
                attempt.wait_for_exit(30)  # woken by the rank's pidfd as it dies, not at the end of the wait
                waited = time.monotonic() - waited
                attempt.poll()
            finally:
                os.kill(parent, signal.SIGCONT)
            assert waited < 30, "the wait was not woken by the rank's end"
            ended = attempt.exits[1]
            assert (ended.vanished, ended.signal, ended.exit_code) == (False, how, None), (trial, ended)
            assert 0 not in attempt.exits  # the other rank lives on: its parent reaps, it does not stop its ranks
        finally:
            attempt.stop(0.5)
        assert attempt.ended and not attempt._pidfds  # every pidfd closed with the attempt
