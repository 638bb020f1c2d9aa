"""Signals the launcher sends to processes it did not fork itself (ranks are the torchrun agents' children; after a
take-over even the agents are a dead healer's), each checked first: the pid must still be the process that was
found (its start time, from /proc) and belong to the attempt (its torchrun run id). A pid the kernel has given to
another process since, after a backoff of minutes or a healer that died, is never signalled, whoever runs us.

The check and the signal go through a pidfd: opened before the check, it names the process the pid named at that
moment, so a pid reused between the check and the signal cannot receive it (a process that was started after the
pidfd was opened cannot carry the start time the check compares against).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

from ground import procfs

log = logging.getLogger(__name__)
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun in every worker's environment: the rendezvous id, `JOB-ATTEMPT` under the local launcher."""


@dataclass(frozen=True, slots=True)
class Target:
    """A process the launcher may signal: its pid, when it started (procfs.Stat.started) and the run id it must carry
    (None: the start time alone identifies it, for a process found some other way)."""

    pid: int
    started: float
    run_id: str | None = None


def carries(pid: int, run_id: str) -> bool:
    """Whether `pid` belongs to torchrun run `run_id`: a worker (or anything it started) by its environment, an agent
    by its `--rdzv-id` argument."""
    if procfs.environ(pid).get(RUN_ID_ENV) == run_id:
        return True
    argv = procfs.cmdline(pid)
    return any(a in ("--rdzv-id", "--rdzv_id") and v == run_id for a, v in zip(argv, argv[1:])) or \
        f"--rdzv-id={run_id}" in argv or f"--rdzv_id={run_id}" in argv


def identify(pid: int, run_id: str | None, started: float | None = None) -> Target | None:
    """The process `pid` names now as a Target, if it belongs to `run_id` (and, given `started`, started then);
    None when it is gone, a zombie, or another process."""
    now_started = procfs.start_time(pid)
    if now_started is None or (started is not None and now_started != started):
        return None
    if run_id is not None and not carries(pid, run_id):
        return None
    # NOTE: read again: the environment read above must have been this process's, not a successor's.
    return Target(pid, now_started, run_id) if procfs.is_same_process(pid, now_started) else None


def is_current(t: Target) -> bool:
    """Whether `t.pid` still names that process and it can still run (not a zombie)."""
    return procfs.is_same_process(t.pid, t.started) and procfs.alive(t.pid)


def send(t: Target, sig: int) -> bool:
    """Signal `t` if its pid still names that process (and it carries its run id); True when sent. A pid that now
    names another process is refused and logged."""
    try:
        fd: int | None = os.pidfd_open(t.pid)
    except ProcessLookupError:
        return False
    except OSError:  # NOTE: no pidfd (a kernel before 5.3, a seccomp filter): check, then kill, as before them
        fd = None
    try:
        if not procfs.is_same_process(t.pid, t.started):
            if procfs.alive(t.pid):
                log.warning("not sending signal %d to pid %d: it is no longer the process found (started %.2f s "
                            "after boot); the pid was reused", sig, t.pid, t.started)
            return False
        if t.run_id is not None and procfs.alive(t.pid) and not carries(t.pid, t.run_id):
            log.warning("not sending signal %d to pid %d: it does not belong to run %s", sig, t.pid, t.run_id)
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(t.pid, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def wait_gone(targets: list[Target], timeout_s: float, stuck_s: float = 5.0) -> list[Target]:
    """Wait until none of `targets` can run any more (exited, or its pid reused); returns those still there. Those
    left that stay in the kernel's state D for `stuck_s` on end are given up on early: a SIGKILL reaches a process
    stuck in a driver call, on a dead mount or in a frozen cgroup only when the kernel lets it go, and waiting out
    `timeout_s` only delays whoever must now decide about its host (node-health fails it)."""
    deadline = time.monotonic() + timeout_s
    stuck_since: float | None = None
    while (left := [t for t in targets if is_current(t)]) and time.monotonic() < deadline:
        if all((st := procfs.stat(t.pid)) is not None and st.state == "D" for t in left):
            stuck_since = stuck_since if stuck_since is not None else time.monotonic()
            if time.monotonic() - stuck_since >= stuck_s:
                log.warning("pids %s stuck in the kernel (state D) %.0f s after SIGKILL: not waiting longer",
                            [t.pid for t in left], stuck_s)
                return left
        else:
            stuck_since = None
        time.sleep(0.05)
    if left:
        log.warning("pids %s still alive %.0f s after SIGKILL", [t.pid for t in left], timeout_s)
    return left
