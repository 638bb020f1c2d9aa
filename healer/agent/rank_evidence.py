"""What a hung rank is doing, read from outside it on its own host: its kernel state and the kernel function it
sleeps in, the training phase it entered last and since when (wire/phase_now.py), its Python stacks, and its
flight recorder's last collectives per process group (exporters/flight_recorder.py: asked for first, through a request
file its dump thread answers, and read last, so the stacks are dumped while the ranks write theirs).

The stacks come from py-spy (`py-spy dump --json --nonblocking`): it reads the process's memory without stopping
it, so it also answers for a rank that is stopped or frozen in the kernel, where attaching with ptrace would wait
for good. Each dump runs as an argument list with a timeout; a rank whose dump fails still has its state and phase.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ground import procfs
from wire import phase_now, recorder_files

DUMP_TIMEOUT_S = 10.0
RECORDER_WAIT_S = 1.5
CANNOT_ANSWER = (None, "T", "t", "Z")
"""Kernel states of a rank whose flight recorder thread cannot run: gone, stopped, dead. (Not D: a rank in a disk read
for a moment answers right after; a frozen one costs the wait.)"""
"""How long after the stacks the ranks' flight recorder answers are waited for (their threads poll twice a second)."""
MAX_FRAMES = 40
"""Frames kept per thread, innermost first (a deep recursion says no more after that)."""


@dataclass(frozen=True, slots=True)
class Frame:
    function: str
    file: str
    line: int

    def text(self) -> str:
        return f"{self.function} ({self.file}:{self.line})"


@dataclass(slots=True)
class RankEvidence:
    pid: int
    rank: int | None
    state: str | None
    """The kernel's state letter: R running, S sleeping, D uninterruptible, T stopped; None: the process is gone."""
    wchan: str | None
    phase: phase_now.PhaseNow | None
    stack: list[Frame] = field(default_factory=list)
    """The main thread's Python frames, innermost first ([] when the dump failed)."""
    threads: int = 0
    error: str | None = None
    """Why there is no stack."""
    collectives: dict[str, Any] | None = None
    """The flight recorder's view, per process group (None: the rank keeps none, or did not answer in time)."""

    def to_payload(self, now_ns: int | None = None) -> dict[str, Any]:
        return {"pid": self.pid, "rank": self.rank, "state": self.state, "wchan": self.wchan,
                "phase": self.phase.to_payload(now_ns) if self.phase is not None else None,
                "stack": [f.text() for f in self.stack], "threads": self.threads, "error": self.error,
                "collectives": self.collectives}


def py_spy() -> str | None:
    """The py-spy beside this interpreter (the venv's), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def collect(pid: int, rank: int | None, phase_dir: Path | None, timeout_s: float = DUMP_TIMEOUT_S) -> RankEvidence:
    """Everything this host can say about rank process `pid`."""
    st = procfs.stat(pid)
    phase = phase_now.read(phase_now.path_for(phase_dir, pid)) if phase_dir is not None else None
    ev = RankEvidence(pid=pid, rank=rank if rank is not None else (phase.rank if phase else None),
                      state=st.state if st is not None else None, wchan=procfs.wchan(pid), phase=phase)
    if st is None:
        ev.error = "the process is gone"
        return ev
    try:
        ev.stack, ev.threads = dump_stack(pid, timeout_s)
    except StackUnavailable as exc:
        ev.error = str(exc)
    return ev


class StackUnavailable(Exception):
    pass


def dump_stack(pid: int, timeout_s: float = DUMP_TIMEOUT_S) -> tuple[list[Frame], int]:
    """The main thread's frames (innermost first) and the number of Python threads of `pid`."""
    exe = py_spy()
    if exe is None:
        raise StackUnavailable("py-spy is not installed")
    argv = [exe, "dump", "--pid", str(pid), "--json", "--nonblocking"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise StackUnavailable(f"py-spy took more than {timeout_s:g} s") from None
    if out.returncode != 0:
        raise StackUnavailable(f"py-spy failed (exit {out.returncode}): {out.stderr.strip()[-300:]}")
    return parse_dump(out.stdout)


def parse_dump(text: str) -> tuple[list[Frame], int]:
    """py-spy's JSON: a list of threads, each with its frames innermost first."""
    try:
        threads = json.loads(text)
    except ValueError as exc:
        raise StackUnavailable(f"py-spy printed no JSON: {exc}") from None
    if not isinstance(threads, list) or not threads:
        raise StackUnavailable("py-spy found no Python thread")
    main = next((t for t in threads if isinstance(t, dict) and t.get("thread_name") == "MainThread"), threads[0])
    frames = [Frame(function=str(f.get("name", "?")), file=str(f.get("short_filename") or f.get("filename", "?")),
                    line=int(f.get("line") or 0))
              for f in (main.get("frames") or [])[:MAX_FRAMES] if isinstance(f, dict)]
    return frames, len(threads)


def collect_all(ranks: dict[int, int | None], phase_dir: Path | None,
                timeout_s: float = DUMP_TIMEOUT_S, recorder_wait_s: float = RECORDER_WAIT_S,
                ) -> tuple[list[dict[str, Any]], float]:
    """Evidence of each rank process ({pid: rank or None}), as payloads, and how long it took (s)."""
    t0 = time.monotonic()
    now = time.time_ns()
    if phase_dir is not None:
        for pid in ranks:
            _ask_recorder(phase_dir, pid)
    found = [collect(pid, rank, phase_dir, timeout_s) for pid, rank in sorted(ranks.items())]
    if phase_dir is not None:
        deadline = time.monotonic() + recorder_wait_s
        for ev in found:
            if ev.state in CANNOT_ANSWER:
                # Every thread of a stopped rank is held: its dump thread cannot answer, and waiting for it cost the
                # SIGSTOP hang 1.5 s of its naming on the bench.
                recorder_files.request_path(phase_dir, ev.pid).unlink(missing_ok=True)
                continue
            ev.collectives = _recorder_answer(phase_dir, ev.pid, deadline)
    return [ev.to_payload(now) for ev in found], time.monotonic() - t0


def _ask_recorder(phase_dir: Path, pid: int) -> None:
    recorder_files.answer_path(phase_dir, pid).unlink(missing_ok=True)  # an old answer is not this hang's
    try:
        recorder_files.request_path(phase_dir, pid).touch()
    except OSError:
        pass  # no directory: the rank keeps no phase file, and no recorder thread either


def _recorder_answer(phase_dir: Path, pid: int, deadline: float) -> dict[str, Any] | None:
    """The rank's answer once it is there (None by the deadline: no recorder, or its thread cannot run)."""
    path = recorder_files.answer_path(phase_dir, pid)
    while True:
        try:
            answer = json.loads(path.read_text())
            return answer if isinstance(answer, dict) else None
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                recorder_files.request_path(phase_dir, pid).unlink(missing_ok=True)
                return None
            time.sleep(0.05)
