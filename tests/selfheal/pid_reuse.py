"""A rank's pid given to another process, for real: run as pid 1 of a PID namespace of its own (see
tests/selfheal/test_kill_safety.py, which starts it under `unshare --user --map-root-user --pid --fork
--mount-proc`), where /proc/sys/kernel/ns_last_pid picks the next pid.

A host's part of an attempt (healer/agent/host.py) whose "torchrun" starts one worker (RANK and TORCHELASTIC_RUN_ID
set, as torchrun sets them) and reaps it when it dies; the node agent's poll finds the worker as rank 0. The worker
is killed, and a decoy that carries the same run id gets its pid. The attempt is then stopped and asked to signal
rank 0. Prints one JSON line: whether the pid was reused and whether the decoy survived each.

    unshare --user --map-root-user --pid --fork --mount-proc python -m tests.selfheal.pid_reuse RUN_DIR
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ground import procfs
from healer.agent.host import HostAttempt
from wire.run_ids import run_id

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
AGENT = """import os, subprocess, sys, time
env = dict(os.environ, RANK="0", LOCAL_RANK="0", TORCHELASTIC_RUN_ID=sys.argv[1])
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
worker.wait()  # the agent reaps its worker, as torchrun's does
time.sleep(600)
"""


def wait(what: str, probe: object, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def main(run_dir: Path) -> dict[str, object]:
    attempt = HostAttempt(job="j", attempt=0, node_rank=0, argv=[sys.executable, "-c", AGENT, run_id("j", 0)],
                          env=dict(os.environ), cwd=run_dir, log_dir=run_dir / "host")
    attempt.start()
    wait("the worker", lambda: attempt.poll() or attempt.ranks)  # type: ignore[func-returns-value]
    (worker,) = attempt.ranks
    os.kill(worker, signal.SIGKILL)  # the rank dies; its agent reaps it
    wait("the worker reaped", lambda: procfs.stat(worker) is None)
    attempt.poll()
    decoy = None
    for _ in range(5):  # NOTE: only our processes live in this namespace; retry in case one of them took the pid
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(worker - 1))
        decoy = subprocess.Popen(SLEEP, env=dict(os.environ, RANK="0", TORCHELASTIC_RUN_ID=run_id("j", 0)))
        if decoy.pid == worker:
            break
        decoy.kill()
        decoy.wait()
    assert decoy is not None
    result: dict[str, object] = {"reused": decoy.pid == worker}
    attempt.stop(grace_s=1.0)
    result["alive_after_stop"] = decoy.poll() is None
    try:
        attempt.signal(0, signal.SIGKILL)
        result["kill_rank"] = "sent"
    except LookupError:
        result["kill_rank"] = "refused"
    except ProcessLookupError:  # sent unchecked to a pid nobody has any more
        result["kill_rank"] = "sent"
    time.sleep(0.2)
    result["alive_after_kill_rank"] = decoy.poll() is None
    decoy.kill()
    return result


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))), flush=True)
