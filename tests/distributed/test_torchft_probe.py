"""What torchft 0.2.0 does on this machine's torch (2.13, CPU) and gloo, before megaheal builds fault tolerance per
data-parallel replica on it: three replica groups of one rank (tests/distributed/ft_replica.py) and a Lighthouse on
the loopback. One group is SIGKILLed mid-run: the other two go on stepping without it, and once it is started again
it joins the quorum and takes its state from a live peer (no file: through megaheal's authenticated transport,
train/ft/transport.py), and every group ends at the same weights, bit for
bit, as each step's update is the same whoever took part in it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support import free_port, wait_for

pytestmark = pytest.mark.multiprocess
STEPS = 100


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


@pytest.mark.timeout(240)
def test_a_killed_replica_group_leaves_the_others_stepping_and_rejoins_from_a_live_peer(tmp_path: Path) -> None:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=2000)
    url = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    outs = [tmp_path / f"group{g}.jsonl" for g in range(3)]
    key = tmp_path / "run.key"
    key.touch(mode=0o600)
    key.write_bytes(os.urandom(32))
    ports = [free_port() for _ in range(3)]

    def start(g: int) -> subprocess.Popen[bytes]:
        log = (tmp_path / f"group{g}.log").open("ab")
        return subprocess.Popen([sys.executable, "-m", "tests.distributed.ft_replica", "--group", str(g),
                                 "--lighthouse", url, "--store-port", str(ports[g]), "--steps", str(STEPS),
                                 "--out", str(outs[g]), "--key-file", str(key)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = [start(g) for g in range(3)]

    def past(step: int) -> bool:
        for g, p in enumerate(procs):
            if p.poll() not in (None, 0):
                raise AssertionError((tmp_path / f"group{g}.log").read_text()[-3000:])
        return all(any(r["step"] >= step for r in records(o)) for o in outs)

    try:
        wait_for("every group past step 8", lambda: past(8), 120, every_s=0.1)
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(10)
        killed_at, killed_step = time.time(), max(r["step"] for r in records(outs[2]))
        wait_for("the others step on without it", lambda: any(r["participants"] == 2 and r["time"] > killed_at
                                                              for r in records(outs[0])), 60, every_s=0.1)

        procs[2] = start(2)
        for p in procs:
            assert p.wait(180) == 0, (tmp_path / "group2.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    by_group = [records(o) for o in outs]
    # The two that were never killed committed every step from the one they first joined at (a group that starts
    # late joins the quorum by healing from a peer, as a restarted one does) to the end, on through the loss: a
    # step whose quorum lost a peer mid-way is not committed with a hole.
    for g in (0, 1):
        steps = [r["step"] for r in by_group[g]]
        assert steps == list(range(steps[0], STEPS)) and steps[0] < 8, (g, steps)
    # Without it from the step after its last: two participants until it is back.
    two = [r["step"] for r in by_group[0] if r["participants"] == 2 and r["time"] > killed_at]
    assert two and min(two) <= killed_step + 2, (two, killed_step)
    # The restarted group did not start over: it took a live peer's state at the step the others had reached.
    again = [r for r in by_group[2] if r["time"] > killed_at]
    assert again and again[0]["step"] > killed_step + 1 and again[-1]["step"] == STEPS - 1, again[:3]
    # Every step's update is the same whoever took part: the groups' weights agree bit for bit at every step both
    # committed, the rejoined group's included.
    sums: dict[int, set[int]] = {}
    for rows in by_group:
        for r in rows:
            sums.setdefault(r["step"], set()).add(r["checksum"])
    assert sorted(sums) == list(range(STEPS)) and all(len(c) == 1 for c in sums.values()), \
        {s: c for s, c in sums.items() if len(c) > 1}
    stalled = max(b["time"] - a["time"] for a, b in zip(by_group[0], by_group[0][1:]))
    print(f"\ntorchft {version('torchft')}: group 2 killed at step "
          f"{killed_step}; the others' longest step gap {stalled:.2f} s; group 2 rejoined at step {again[0]['step']}")
