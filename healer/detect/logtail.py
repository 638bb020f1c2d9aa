"""Classifying why a rank crashed from its exit status and the tail of its log.

The classes, most specific first: out of memory, a NCCL error, a gloo error (often only the echo of another
rank's death: the peer closed the connection), a segfault, a Python exception (its type named), killed by a
signal, or a plain non-zero exit. Only the text is matched: nothing from the log is ever executed.
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass

OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|Cannot allocate memory|std::bad_alloc|MemoryError")
NCCL = re.compile(r"NCCL error|ncclSystemError|ncclUnhandledCudaError|ncclInternalError|NCCL WARN|NCCL timeout|"
                  r"ProcessGroupNCCL")
GLOO = re.compile(r"gloo|Connection closed by peer|Connection reset by peer|ProcessGroupGloo", re.IGNORECASE)
SEGV = re.compile(r"Segmentation fault|SIGSEGV|Fatal Python error: Segmentation")
EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning))(?::|$)")
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
"""What torchrun puts before each line a rank writes (its stderr.log keeps it): taken off before matching."""
FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
# Peer-failure text: a rank that dies because another one did. It is a consequence, not a cause.
PEER = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|recvBytes|"
                  r"Application timeout caused pair closure", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class CrashClass:
    category: str
    """oom | nccl | gloo | segfault | python-exception | signal | exit-code | unknown"""
    detail: str
    """The exception type, the signal's name or the exit code."""
    line: str = ""
    """The log line that decided it (at most 300 characters)."""
    peer_failure: bool = False
    """The text says a peer went away: probably a consequence of another rank's crash."""

    def to_payload(self) -> dict[str, object]:
        return {"category": self.category, "detail": self.detail, "line": self.line, "peer_failure": self.peer_failure}


def signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def classify(exit_code: int | None, sig: int | None, tail: tuple[str, ...] | list[str]) -> CrashClass:
    lines = [line for line in _lines(tail) if line.strip()]
    peer = any(PEER.search(line) for line in lines)
    for pattern, category in ((OOM, "oom"), (NCCL, "nccl")):
        hit = _last(lines, pattern)
        if hit is not None:
            return CrashClass(category, _exception_type(lines) or category, hit[:300], peer)
    segv = _last(lines, SEGV)
    if sig == _signal.SIGSEGV or exit_code == -_signal.SIGSEGV or segv is not None:
        return CrashClass("segfault", "SIGSEGV", (segv or "")[:300], peer)
    exc = _exception_type(lines)
    gloo = _last(lines, GLOO)
    if gloo is not None:
        return CrashClass("gloo", exc or "gloo", gloo[:300], peer)
    if exc is not None:
        return CrashClass("python-exception", exc, (_last(lines, re.compile(re.escape(exc))) or "")[:300], peer)
    if sig is not None:
        # NOTE: SIGTERM is how torchrun stops a failed worker's peers: a rank it ended is an echo of another's failure
        # (a user's script dies of it; megaheal's trainer catches it). Were every rank ended so (a preemption), the
        # crash still names the first.
        return CrashClass("signal", signal_name(sig), "", peer or sig == _signal.SIGTERM)
    if exit_code is None:
        # Neither a status nor a telling log line: the process vanished (reaped before it could be read).
        return CrashClass("unknown", "status unknown", lines[-1][:300] if lines else "", peer)
    return CrashClass("exit-code", str(exit_code), lines[-1][:300] if lines else "", peer)


def signature(cls: CrashClass, tail: tuple[str, ...] | list[str]) -> str | None:
    """What a failure of the application looks like wherever it happens: the exception's type and the innermost frame
    of its traceback ("ValueError at model.py:212 in forward"; the file by its name only, as hosts install it under
    different paths). None for what is not a Python exception in the program (a signal, a peer's echo, out of
    memory, NCCL: the host or its neighbours may be to blame) or has no frame to name."""
    if cls.category != "python-exception" or cls.peer_failure:
        return None
    frame = _innermost_frame(_lines(tail))
    return f"{cls.detail} at {frame}" if frame is not None else None


def _lines(tail: tuple[str, ...] | list[str]) -> list[str]:
    """The tail's lines as the rank wrote them (torchrun's "[rankN]: " taken off)."""
    return [RANK_PREFIX.sub("", line.rstrip(), count=1) for line in tail]


def _innermost_frame(lines: list[str]) -> str | None:
    for line in reversed(lines):
        m = FRAME.match(line)
        if m:
            return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)} in {m.group(3)}"
    return None


def _last(lines: list[str], pattern: re.Pattern[str]) -> str | None:
    for line in reversed(lines):
        if pattern.search(line):
            return line.strip()
    return None


def _exception_type(lines: list[str]) -> str | None:
    """The type of the last exception a traceback printed (the line after the traceback's frames)."""
    for line in reversed(lines):
        m = EXCEPTION.match(line.strip())
        if m and not line.startswith(" "):
            return m.group(1)
    return None
