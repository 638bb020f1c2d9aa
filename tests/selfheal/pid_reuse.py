"""A rank's pid given to another process, for real: run as pid 1 of a PID namespace of its own (see
tests/selfheal/test_kill_safety.py, which starts it under `unshare --user --map-root-user --pid --fork
--mount-proc`), where /proc/sys/kernel/ns_last_pid picks the next pid.

A supervisor starts an attempt whose "agent" starts one worker (RANK and TORCHELASTIC_RUN_ID set, as torchrun sets
them) and reaps it when it dies; the supervisor finds the worker as rank 0. The worker is killed, and a decoy that
carries the same run id gets its pid. The supervisor then stops the attempt and is asked to signal rank 0. Prints
one JSON line: whether the pid was reused and whether the decoy survived each.

    unshare --user --map-root-user --pid --fork --mount-proc python -m tests.selfheal.pid_reuse RUN_DIR
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from healer.core.processes import ProcessView
from healer.launchers.local import Launcher, LaunchSpec, NodeHandle
from healer.launchers.supervisor import Supervisor
from megaheal import procfs

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
AGENT = """import os, subprocess, sys, time
env = dict(os.environ, RANK="0", LOCAL_RANK="0", TORCHELASTIC_RUN_ID=sys.argv[1])
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
worker.wait()  # the agent reaps its worker, as torchrun's does
time.sleep(600)
"""


class OneWorkerLauncher(Launcher):
    def start(self, spec: LaunchSpec) -> list[NodeHandle]:
        spec.attempt_dir.mkdir(parents=True, exist_ok=True)
        log = spec.attempt_dir / "n1.log"
        log.touch()
        agent = subprocess.Popen([sys.executable, "-c", AGENT, f"{spec.job}-{spec.attempt}"])
        return [NodeHandle(node="n1", node_rank=0, process=agent, log_path=log, rank_log_dir=spec.attempt_dir)]

    def run_on(self, node: str, run_dir: Path, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        raise NotImplementedError


def wait(what: str, probe: object, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def main(run_dir: Path) -> dict[str, object]:
    sup = Supervisor(Supervisor.Config(job="j", config="configs/demo.yaml", run_dir=run_dir,
                                       grace=timedelta(seconds=1)), OneWorkerLauncher(), ProcessView(), token="t")
    attempt = sup.start("t", ("n1",), resume=None)
    wait("the worker", lambda: (sup.poll(), attempt.ranks)[1])
    (worker,) = attempt.ranks
    os.kill(worker, signal.SIGKILL)  # the rank dies; its agent reaps it
    wait("the worker reaped", lambda: procfs.stat(worker) is None)
    sup.poll()
    decoy = None
    for _ in range(5):  # NOTE: only our processes live in this namespace; retry in case one of them took the pid
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(worker - 1))
        decoy = subprocess.Popen(SLEEP, env=dict(os.environ, RANK="0", TORCHELASTIC_RUN_ID=f"j-{attempt.number}"))
        if decoy.pid == worker:
            break
        decoy.kill()
        decoy.wait()
    assert decoy is not None
    result: dict[str, object] = {"reused": decoy.pid == worker}
    sup.stop("t")
    result["alive_after_stop"] = decoy.poll() is None
    try:
        sup.kill_rank("t", 0, signal.SIGKILL)
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
