"""The phase a rank is in now, and since when: a 64-byte file per rank process, written in place at every phase
entry (a memory store into a shared mapping: no system call, nothing training could wait on) and read by the node
agent when a job stops making progress. Heartbeats say which phase a rank spent its last *finished* step in; a hung
rank never finishes its step, so this is what says where it is stuck.

The file is `$MEGAHEAL_PHASE_DIR/<pid>.phase` (the agent sets the directory for the ranks it starts and knows their
pids); without the variable nothing is written. Layout (little-endian): magic "MHP1", a sequence number (odd while a
write is in progress: a reader that sees it odd, or changed across its read, reads again), the step, the wall-clock
time of entry (ns), the rank, and the phase name (ASCII, NUL-padded).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ENV = "MEGAHEAL_PHASE_DIR"
MAGIC = b"MHP1"
_HEAD = struct.Struct("<4sI")
_BODY = struct.Struct("<qqi32s")
SIZE = 64
assert _HEAD.size + _BODY.size <= SIZE


def path_for(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"{pid}.phase"


class PhaseBeacon:
    """The writer, one per rank process. `enter` is called by the phase timer as each phase begins; `leave` when a
    nested phase (a collective inside forward/backward) ends and its parent goes on."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        path = path_for(directory, os.getpid())
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.path, self.rank = path, rank
        self._seq = 0
        self._step = 0
        self._stack: list[tuple[str, int, int]] = []
        _HEAD.pack_into(self._map, 0, MAGIC, 0)

    @classmethod
    def from_env(cls, rank: int) -> PhaseBeacon | None:
        directory = os.environ.get(ENV)
        if not directory:
            return None
        try:
            return cls(directory, rank)
        except OSError:
            return None  # telemetry: a directory it cannot write costs the evidence, never the training

    def enter(self, phase: str, step: int | None = None) -> None:
        """`phase` begins; `step` None: the step of the phase it is nested in (or of the last one)."""
        if step is None:
            step = self._stack[-1][1] if self._stack else self._step
        self._step = step
        entry = (phase, step, time.time_ns())
        self._stack.append(entry)
        self._write(*entry)

    def leave(self) -> None:
        if self._stack:
            self._stack.pop()
        if self._stack:
            self._write(*self._stack[-1])  # back in the enclosing phase, since it was entered
        else:
            self._write("", self._step, time.time_ns())  # in no phase (untimed work between two)

    @contextmanager
    def inside(self, phase: str) -> Iterator[None]:
        """`phase` nested in the current one, for the enclosed work."""
        self.enter(phase)
        try:
            yield
        finally:
            self.leave()

    def between(self, step: int) -> None:
        """Outside every phase (between two steps)."""
        self._stack.clear()
        self._step = step
        self._write("", step, time.time_ns())

    def _write(self, phase: str, step: int, at_ns: int) -> None:
        self._seq += 1
        _HEAD.pack_into(self._map, 0, MAGIC, self._seq)  # odd: a write in progress
        _BODY.pack_into(self._map, _HEAD.size, step, at_ns, self.rank, phase.encode("ascii", "replace")[:32])
        self._seq += 1
        _HEAD.pack_into(self._map, 0, MAGIC, self._seq)

    def close(self) -> None:
        self._map.close()
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class PhaseNow:
    rank: int
    step: int
    phase: str
    """"" between two phases (or steps)."""
    since_ns: int
    """Wall-clock time (ns) the rank entered it."""

    def to_payload(self, now_ns: int | None = None) -> dict[str, object]:
        out: dict[str, object] = {"rank": self.rank, "step": self.step, "phase": self.phase or None,
                                  "since": self.since_ns / 1e9}
        if now_ns is not None:
            out["for_s"] = round(max(0, now_ns - self.since_ns) / 1e9, 3)
        return out


def read(path: Path, attempts: int = 5) -> PhaseNow | None:
    """The phase recorded in `path`; None when there is no such file, it is not one, or it never read whole.

    NOTE: the file goes away while it is read whenever its rank ends a trainer (a rank that exits, a warm worker
    between two generations: PhaseBeacon.close unlinks it), so every read of it may fail: each one is guarded. A
    reader that raised here once killed a node agent's poll thread (tests/exporters/test_phase_now.py)."""
    raw = _read_whole(path)
    for _ in range(attempts):
        if raw is None or len(raw) < SIZE:
            return None
        magic, seq = _HEAD.unpack_from(raw, 0)
        if magic != MAGIC or seq == 0:
            return None  # not a beacon, or one that has recorded no phase yet
        if seq % 2 == 0:
            step, at_ns, rank, name = _BODY.unpack_from(raw, _HEAD.size)
            again = _read_whole(path)
            if again is None:
                return None  # gone between the two reads: the rank left the phase with its trainer
            if again[:_HEAD.size] == raw[:_HEAD.size]:
                return PhaseNow(rank=rank, step=step, phase=name.rstrip(b"\0").decode("ascii", "replace"),
                                since_ns=at_ns)
            raw = again
        else:
            raw = _read_whole(path)
    return None


def _read_whole(path: Path) -> bytes | None:
    """The file's bytes; None when it cannot be read (removed, replaced by a directory, not ours to read)."""
    try:
        return path.read_bytes()
    except OSError:
        return None
