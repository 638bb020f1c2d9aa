"""This host's processes as /proc shows them: the one reader for the healer, the node sidecar, the runbooks,
the benchmarks and the tests.

psutil reads what it reads well: the process tree (from every process's parent: the kernel's own list,
/proc/PID/task/TID/children, needs CONFIG_PROC_CHILDREN and is documented as reliable only for stopped or
frozen tasks), arguments, environment and memory. /proc/PID/stat is parsed here, because psutil has no field
for what the launcher needs most in it: the exit status a zombie keeps until its parent reaps it (field 52,
Linux >= 3.5), which tells how a rank died while its torchrun agent is still stopping the others. The same
read gives the kernel's state letter, CPU time and start time as one snapshot (psutil's status() and
cpu_times() would parse the same file again, and give the state as a word where callers keep the kernel's
letter). The few readers written here take a `proc` root, so tests can parse fixture files; the psutil ones
read the real /proc.

Every read tolerates the process vanishing, or being someone else's, under it: the answer is then what a
process that is gone gives (None, [] or {}). A zombie (Z) or a dying task (X) is not alive, whoever reaps it.

NOTE: pids are those of the caller's PID namespace: the sidecar must share the ranks' (same host, or a pod
sharing its PID namespace).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
NOT_ALIVE = frozenset("ZXx")
"""Zombie, and dead ("x" on kernels 2.6.33 to 3.13): the task has left, whoever reaps it."""

# ZombieProcess is a NoSuchProcess: a zombie has no arguments or environment left to read.
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied)
_UNREADABLE = (FileNotFoundError, ProcessLookupError, PermissionError)


# ---- the process tree, arguments and environment (psutil) -------------------------------------------------


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, zombies not yet reaped included.

    NOTE: psutil reads the parent of every process on the host (/proc/*/stat) for this: about 12 us a
    process on a development machine, so ~25 ms a call on a host running 2,000 processes.
    """
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except _GONE:
        return []


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts each rank in a session of its own, so signalling the
    launcher's process group does not reach the ranks: they are found here, one by one)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except _GONE:
        return []


def cmdline(pid: int) -> list[str]:
    """The process's arguments ([] when it is gone, a zombie, or unreadable)."""
    try:
        return list(psutil.Process(pid).cmdline())
    except _GONE:
        return []


def environ(pid: int) -> dict[str, str]:
    """The environment the process started with ({} when it is gone, a zombie, or another user's)."""
    try:
        return dict(psutil.Process(pid).environ())
    except _GONE:
        return {}


def worker_rank(pid: int) -> int | None:
    """The global rank torchrun gave worker `pid` (RANK, set by its agent), or None when it is not a worker
    (or gone)."""
    value = environ(pid).get("RANK")
    return int(value) if value is not None and value.isdigit() else None


def rss_bytes(pid: int) -> int | None:
    """Resident memory of `pid` now, or None when it is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except _GONE:
        return None


# ---- /proc/PID/stat: state, CPU time, start and a zombie's exit status (psutil lacks field 52) -------------


@dataclass(frozen=True, slots=True)
class Stat:
    """One read of /proc/PID/stat."""

    comm: str
    """The command name (at most 15 bytes: the kernel cuts it)."""
    state: str
    """The kernel's state letter: R running, S sleeping, D uninterruptible (inside the kernel), T stopped,
    t traced, Z zombie, X dying."""
    cpu_seconds: float
    """User + system CPU time so far."""
    started: float
    """When the process started, in seconds after boot (field 22, to a clock tick): with the pid, what
    tells this process from a later one given the same pid. Unlike psutil's create_time (boot time plus
    this), a change of the wall clock does not move it, so one healer can write it down and the next compare."""
    wait_status: int | None = None
    """A zombie's exit status as waitpid reports it (field 52), until its parent reaps it; None otherwise."""

    @property
    def exit_code(self) -> int | None:
        if self.wait_status is None or os.WIFSIGNALED(self.wait_status):
            return None
        return os.WEXITSTATUS(self.wait_status)

    @property
    def signal(self) -> int | None:
        if self.wait_status is None or not os.WIFSIGNALED(self.wait_status):
            return None
        return os.WTERMSIG(self.wait_status)


def stat(pid: int, proc: Path = PROC) -> Stat | None:
    """`pid`'s kernel state, CPU time, start and, for a zombie, exit status; None when it is gone."""
    try:
        raw = (proc / str(pid) / "stat").read_bytes()
    except _UNREADABLE:
        return None
    # NOTE: the command name (field 2) may hold spaces, parentheses and bytes that are not UTF-8: split after
    # its last ')'.
    head, _, tail = raw.decode(errors="replace").rpartition(")")
    fields = tail.split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15, starttime 22, exit_code 52.
    wait_status = int(fields[49]) if fields[0] == "Z" and len(fields) > 49 else None
    return Stat(comm=head.partition("(")[2], state=fields[0],
                cpu_seconds=(int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
                started=int(fields[19]) / CLOCK_TICKS, wait_status=wait_status)


def state(pid: int, proc: Path = PROC) -> str | None:
    """`pid`'s kernel state letter (R, S, D, T for stopped, t for traced, Z, ...); None when it is gone."""
    st = stat(pid, proc)
    return st.state if st is not None else None


def alive(pid: int, proc: Path = PROC) -> bool:
    """True while `pid` can still run: a zombie or a dying task has left, whoever reaps it."""
    return state_is_alive(state(pid, proc))


def state_is_alive(letter: str | None) -> bool:
    """Whether a process in kernel state `letter` (None: gone) can still run."""
    return letter is not None and letter not in NOT_ALIVE


def wchan(pid: int, proc: Path = PROC) -> str | None:
    """The kernel function `pid` sleeps in ("pipe_read", "futex_wait_queue", "do_freezer_trap", ...); None when it
    is running (the kernel says "0"), gone, or the kernel hides it."""
    try:
        text = (proc / str(pid) / "wchan").read_text().strip()
    except _UNREADABLE:
        return None
    return text if text and text != "0" else None


def start_time(pid: int, proc: Path = PROC) -> float | None:
    """When `pid` started, in seconds after boot (see Stat.started); None when it is gone."""
    st = stat(pid, proc)
    return None if st is None else st.started


def is_same_process(pid: int, started: float, proc: Path = PROC) -> bool:
    """True when `pid` is still the process that started at `started` (a start_time read earlier), false when
    it is gone or the pid now names a later process. A zombie is still the same process: check alive() too
    where that matters."""
    st = stat(pid, proc)
    return st is not None and st.started == started


# ---- what psutil leaves out: every process, open descriptors, peak memory ----------------------------------


def pids(proc: Path = PROC) -> list[int]:
    """Every process on the host, in pid order."""
    return sorted(int(entry) for entry in os.listdir(proc) if entry.isdigit())


def open_files(pid: int, proc: Path = PROC) -> list[str] | None:
    """What each open file descriptor of `pid` points at: paths, device files, "socket:[N]", "pipe:[N]" (psutil's
    open_files keeps regular files only, and a GPU is a device file). [] when it is gone; None when we may not
    look (another user's process)."""
    fd_dir = proc / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return []
    except PermissionError:
        return None
    targets = []
    for fd in fds:
        try:
            targets.append(os.readlink(fd_dir / fd))
        except OSError:
            continue  # closed while we looked
    return targets


def peak_rss_bytes(pid: int, proc: Path = PROC) -> int | None:
    """The most resident memory `pid` has held (VmHWM in /proc/PID/status), or None when it is gone."""
    try:
        lines = (proc / str(pid) / "status").read_text().splitlines()
    except _UNREADABLE:
        return None
    kib = next((line.split()[1] for line in lines if line.startswith("VmHWM:")), None)
    return None if kib is None else int(kib) * 1024
