"""torchft's Lighthouse for a job of replica groups (train/ft/), kept by the job's healer: where the groups agree on
each step's quorum. It runs in a process of its own, started again on the same address and port when it dies (the
groups' managers know it by that address, and ride out the gap: ft.lighthouse_retries), so a Lighthouse that
crashes costs the job a few seconds, not its groups. It listens on the address the healer listens on towards its
hosts (the loopback for local agents, the allocation's address of the healer's host under Slurm), never on every
interface.

NOTE: the Lighthouse (torchft 0.2.0, a gRPC server in Rust) authenticates no one: whoever reaches it can join a
quorum or see who takes part. What a group takes from a peer it authenticates itself (train/ft/transport.py: the
run's key); docs/operations.md says what is left open.

    python -m healer.runner.lighthouse --bind 10.0.0.1:0 --min-groups 2    # prints its port, then serves
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

JOIN_TIMEOUT_MS = 1000
"""How long a quorum waits for a group that heartbeats but has not asked to join yet (one starting up, or slow)
before it forms without it: at most this much is added to a step while a group is on its way in. torchft's default
(60 s) would hold every step of the job that long."""
QUORUM_TICK_MS = 50
HEARTBEAT_TIMEOUT_MS = 2000
"""A group whose manager has not heartbeated for this long is no longer counted (a lost host's): the others wait
about this long for a quorum without it."""
START_TIMEOUT_S = 30.0
RESTART_BACKOFF_S = 0.5


class Lighthouse:
    """The Lighthouse's process, started now and kept running until `stop`.

        lighthouse = Lighthouse("10.0.0.1", min_groups=2, log_path=run_dir / "launcher" / "lighthouse.log")
        lighthouse.url    # http://10.0.0.1:PORT, what every group is told
    """

    def __init__(self, host: str, min_groups: int, log_path: Path) -> None:
        self.host, self.min_groups, self.log_path = host, min_groups, log_path
        self._bracketed = f"[{host}]" if ":" in host else host
        self._stopping = threading.Event()
        self.restarts = 0
        """How often it died and was started again."""
        self.port = 0
        self._proc = self._spawn()
        self.url = f"http://{self._bracketed}:{self.port}"
        self._keeper = threading.Thread(target=self._keep, name="megaheal-lighthouse", daemon=True)
        self._keeper.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _spawn(self) -> subprocess.Popen[str]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = os.environ | {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        with self.log_path.open("a") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "healer.runner.lighthouse", "--bind", f"{self._bracketed}:{self.port}",
                 "--min-groups", str(self.min_groups)],
                stdout=subprocess.PIPE, stderr=log_file, text=True, env=env, start_new_session=True)
        assert proc.stdout is not None
        # NOTE: its first line is its port (chosen by itself on the first start: no window in which another process
        # could take a port picked here); a restart binds the same one.
        timer = threading.Timer(START_TIMEOUT_S, proc.kill)
        timer.start()
        try:
            line = proc.stdout.readline().strip()
        finally:
            timer.cancel()
        if not line.isdigit():
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the Lighthouse did not start on {self._bracketed}:{self.port} (see {self.log_path})")
        self.port = int(line)
        return proc

    def _keep(self) -> None:
        while not self._stopping.is_set():
            code = self._proc.wait()
            if self._stopping.is_set() or code == 0:
                return  # NOTE: 0 is a stop asked for (SIGTERM: the job's end, the allocation's)
            log.error("the Lighthouse exited (%s); starting it again on %s", code, self.url)
            time.sleep(RESTART_BACKOFF_S)
            try:
                self._proc = self._spawn()
                self.restarts += 1
            except (RuntimeError, OSError):
                log.error("the Lighthouse could not be started again; trying again", exc_info=True)
                time.sleep(1.0)

    def stop(self) -> None:
        self._stopping.set()
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._keeper.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m healer.runner.lighthouse", description=__doc__.splitlines()[0])
    parser.add_argument("--bind", required=True, help="HOST:PORT (port 0: any free one)")
    parser.add_argument("--min-groups", type=int, required=True)
    args = parser.parse_args(argv)
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind=args.bind, min_replicas=args.min_groups, join_timeout_ms=JOIN_TIMEOUT_MS,
                              quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    # NOTE: address() names the machine's host name, which the hosts of an allocation may not resolve to the
    # address it listens on: only its port is taken from it.
    print(server.address().rsplit(":", 1)[1], flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
