"""Reading the job's processes from /proc: children, kernel state, CPU time and the torchrun rank of a worker.

torchrun starts each worker in a session of its own, so a worker is found as a child of its node's agent,
and its global rank is read from its environment (RANK, set by the agent). Every read tolerates the
process vanishing under it: a rank that just died is simply not there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def children(pid: int, proc: Path = Path("/proc")) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(proc / str(pid) / "task")
    except (FileNotFoundError, ProcessLookupError):
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (proc / str(pid) / "task" / task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    found: list[int] = []
    for child in children(pid, proc):
        found += [child, *descendants(child, proc)]
    return found


@dataclass(frozen=True, slots=True)
class Stat:
    state: str
    cpu_seconds: float
    wait_status: int | None = None
    """A zombie's exit status as waitpid reports it (stat field 52), until its parent reaps it."""

    @property
    def exit_code(self) -> int | None:
        if self.wait_status is None or os.WIFSIGNALED(self.wait_status):
            return None
        return os.WEXITSTATUS(self.wait_status)

    @property
    def signal(self) -> int | None:
        return os.WTERMSIG(self.wait_status) if self.wait_status is not None and os.WIFSIGNALED(self.wait_status) else None


def stat(pid: int, proc: Path = Path("/proc")) -> Stat | None:
    """The kernel state letter and user+system CPU seconds of `pid`; None when it is gone."""
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # NOTE: the command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = raw[raw.rindex(")") + 2:].split()
    # fields[0] is stat field 3 (state); utime/stime are fields 14/15; exit_code is field 52 (Linux >= 3.5).
    wait_status = int(fields[49]) if fields[0] == "Z" and len(fields) > 49 else None
    return Stat(state=fields[0], cpu_seconds=(int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
                wait_status=wait_status)


def alive(pid: int, proc: Path = Path("/proc")) -> bool:
    """True while `pid` can still run: a zombie (Z) or a dying task (X) has left, whoever reaps it."""
    st = stat(pid, proc)
    return st is not None and st.state not in ("Z", "X")


def cmdline(pid: int, proc: Path = Path("/proc")) -> list[str]:
    """The process's arguments ([] when it is gone, a zombie, or unreadable)."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def environ(pid: int, proc: Path = Path("/proc")) -> dict[str, str]:
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def worker_rank(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The global rank torchrun gave worker `pid`, or None when it is not a worker (or gone)."""
    value = environ(pid, proc).get("RANK")
    return int(value) if value is not None and value.isdigit() else None
