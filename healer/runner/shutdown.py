"""How `megaheal run` holds its run directory and how it leaves.

- `RunDirLock`: one runner per run directory. Two healers on one job would each restart it, and their ranks
  would write the same checkpoints. The lock is an flock on `<run_dir>/launcher/runner.lock`, which names its
  holder (pid, host, since when, command line) for the refusal message; the kernel drops it when the holder dies,
  however it dies, so a lock left by a dead runner is stale by construction and the next runner takes it. A dead
  runner may have left its job running, though: only `--take-over` goes on with such a run (it stops what was left,
  then finishes the incidents); a plain run is refused and told so.
- `Interrupts`: SIGINT (Ctrl-C) and SIGTERM no longer end the process where it stands, which left the job's agents
  and ranks running unwatched (they live in sessions of their own). The first asks the loop to stop the job and
  leave (the ranks get SIGTERM and save a final checkpoint; SIGKILL after the grace); a second one cuts the grace
  short.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from wire.journal import Journal
from wire.run_paths import RunPaths


class RunDirBusy(RuntimeError):
    """The run directory is another runner's, or holds a run that only `--take-over` may go on with."""


class RunDirLock:
    def __init__(self, run_dir: Path, resume: bool) -> None:
        self.run_dir, self.resume = run_dir, resume
        self.path = RunPaths(run_dir).runner_lock
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: 0600, kept so for a file an older runner made 0644: its holder's command line is no one else's
        # business (and a URL's password, were one ever given on it, is redacted below as well).
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise RunDirBusy(f"{self.run_dir} is in use by {self._holder()}: one megaheal run per run directory. "
                             "Stop that one first (Ctrl-C, or kill -TERM its pid: it stops its job on the way out), "
                             "or choose another --run-dir") from None
        unfinished = Journal.of(RunPaths(self.run_dir).journal).unfinished()
        if unfinished is not None and not self.resume:
            os.close(fd)
            raise RunDirBusy(f"{self.run_dir}: the megaheal run before ({self._holder()}) ended without stopping "
                             f"attempt {unfinished} of its job, whose processes may still run: go on with it with "
                             f"`megaheal run --run-dir {self.run_dir} --take-over`, or choose another --run-dir")
        # NOTE: written after the lock is ours, so a refused runner never clobbers the holder's description.
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "argv": [_redacted(a) for a in sys.argv]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def _holder(self) -> str:
        try:
            h: Any = json.loads(self.path.read_text())
            argv = " ".join(map(str, h["argv"])) if isinstance(h.get("argv"), list) else "?"
            return f"megaheal run pid {h['pid']} on {h['host']}, since {h['since']} ({argv})"
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return "another megaheal run (its lock file does not say which)"


class Interrupts:
    """Catches SIGINT and SIGTERM while the job runs (installed on the main thread only: Python delivers signals
    there). `requested()`: stop the job and leave; `hurried()`: a second signal, SIGKILL without the grace."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._old: dict[int, Any] = {}

    def requested(self) -> bool:
        return self.count >= 1

    def hurried(self) -> bool:
        return self.count >= 2

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process that a signal ended."""
        return 128 + (self.signum or signal.SIGINT)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.signum = self.signum or signum
        name = signal.Signals(signum).name
        # NOTE: os.write, not print: the live view may be in the middle of writing to the same stream.
        message = (f"\n{name}: stopping the job (its ranks save a final checkpoint); again to kill it at once\n"
                   if self.count == 1 else f"\n{name}: killing the job now\n")
        os.write(2, message.encode())

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/@\s]*@")


def _redacted(arg: str) -> str:
    """`arg` with the password of any URL in it (scheme://user:PASSWORD@host) replaced by ***."""
    return _URL_PASSWORD.sub(r"\1***@", arg)
