"""Finding and ending the bed's processes from /proc: by namespace, by argument, by pid file.

The bed's daemons detach from whoever started them (a `megaheal testbed up` that exits, or is
killed, leaves them running on purpose), so they are found again here rather than held as children.
A zombie counts as gone: it has released everything, and its reaper may be slow (PID 1 here).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from ground import procfs

PROC = procfs.PROC
alive = procfs.alive
"""Whether `pid` is a live process (not a zombie): the one /proc reader's answer."""


def state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R, S, D, T, Z, ...), None when it is gone."""
    st = procfs.stat(pid)
    return st.state if st is not None else None


def command(pid: int) -> str | None:
    """The process's command name, None when it is gone."""
    st = procfs.stat(pid)
    return st.comm if st is not None else None


def read_pid(path: Path) -> int | None:
    """The pid in a daemon's pid file, when the file exists and that process is alive."""
    try:
        pid = int(path.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None
    return pid if alive(pid) else None


def in_namespace(ns_file: Path, kind: str = "net") -> list[int]:
    """Live processes whose `kind` namespace is the one bound at `ns_file` (e.g. /run/netns/mh1)."""
    try:
        target = os.stat(ns_file)
    except FileNotFoundError:
        return []
    found = []
    for pid in procfs.pids():
        try:
            st = os.stat(PROC / str(pid) / "ns" / kind)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if (st.st_ino, st.st_dev) == (target.st_ino, target.st_dev) and alive(pid):
            found.append(pid)
    return found


def with_argument(fragment: str, programs: Iterable[str]) -> list[int]:
    """Live processes of `programs` (by command name) with an argument that contains `fragment`."""
    found = []
    names = set(programs)
    for pid in procfs.pids():
        if command(pid) in names and any(fragment in a for a in procfs.cmdline(pid)) and alive(pid):
            found.append(pid)
    return found


def kill(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until every pid is gone (or a zombie); the ones still alive at the deadline."""
    left = list(pids)
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        left = [p for p in left if alive(p)]
        if left:
            time.sleep(0.05)
    return left


def stop(pids: Iterable[int], grace_s: float = 3.0) -> list[int]:
    """SIGTERM, then SIGKILL past `grace_s`; the pids that outlived both (frozen ones, say)."""
    pids = list(pids)
    kill(pids, signal.SIGTERM)
    left = wait_gone(pids, grace_s)
    kill(left, signal.SIGKILL)
    return wait_gone(left, 5.0)
