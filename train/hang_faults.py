"""Hangs that are not SIGSTOP, injected from inside one rank (tests, chaos, `make demo`): what real hangs look like.

- `spin`: the rank loops in compute forever (kernel state R: busy, never in a collective);
- `data`: the rank blocks in data loading (S: a loader waiting for a worker or a storage read that never comes);
- `collective`: the rank skips the step's collectives and waits in another one that no peer enters (each side
  waits in a different collective: a rank that took another code path);
- `syscall`: the rank blocks in a read(2) that never returns (S, in the kernel's pipe read: a read from a dead
  mount or a device that stopped answering), in the checkpoint phase at the end of its step.

Each fires on its rank when that rank reaches `at_step` in the phase the mode belongs to, and never returns: the rank
holds the job until the healer stops it, and its peers block in the step's next collective. Each fires once per run:
before it hangs, the rank leaves a mark in the run directory, and the attempts after it (which resume before
`at_step`) pass the fault by.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

MODES = {"spin": "forward_backward", "data": "data_wait", "collective": "forward_backward", "syscall": "checkpoint"}
"""Each mode and the phase it hangs in."""


@dataclass(kw_only=True, slots=True)
class HangFault:
    mode: str
    at_step: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.at_step < 0 or self.rank < 0:
            raise ValueError(f"at_step and rank must be >= 0, got {self.at_step}, {self.rank}")

    @property
    def mark(self) -> str:
        return f"hang-{self.mode}-step{self.at_step}-rank{self.rank}.fired"


class HangInjector:
    """The configured hangs of this rank; `maybe(step, phase)` is called as each phase begins."""

    def __init__(self, faults: list[HangFault], rank: int, run_dir: Path) -> None:
        self.marks = run_dir / "chaos"
        self.faults = [f for f in faults if f.rank == rank and not (self.marks / f.mark).exists()]
        self._other: dist.ProcessGroup | None = None
        if any(f.mode == "collective" for f in faults) and dist.is_initialized():
            # NOTE: creating a group is itself collective: every rank creates it (they share the config), and only
            # the faulty one ever uses it. A timeout of a week: it waits until the healer stops it.
            self._other = dist.new_group(timeout=timedelta(days=7))

    def maybe(self, step: int, phase: str) -> None:
        for fault in self.faults:
            if step == fault.at_step and MODES[fault.mode] == phase:
                self._hang(fault, step, phase)

    def _hang(self, fault: HangFault, step: int, phase: str) -> None:
        self.marks.mkdir(parents=True, exist_ok=True)
        (self.marks / fault.mark).write_text(f"rank {fault.rank} hung ({fault.mode}) at step {step}, in {phase}\n")
        print(f"fault injection: rank {fault.rank} hangs ({fault.mode}) at step {step}, in {phase}", flush=True)
        {"spin": _spin_in_compute, "data": _block_in_data_loading, "collective": self._wait_in_another_collective,
         "syscall": _block_in_read}[fault.mode]()

    def _wait_in_another_collective(self) -> None:
        if self._other is None:
            raise RuntimeError("the collective hang needs a process group")
        dist.barrier(group=self._other)


def _spin_in_compute() -> None:
    x = 0
    while True:
        x = (x * 31 + 7) % 1_000_003


def _block_in_data_loading() -> None:
    threading.Event().wait()


def _block_in_read() -> None:
    # A pipe whose write end this process holds and never writes to: read(2) sleeps in the kernel for good.
    read_end, _write_end = os.pipe()
    os.read(read_end, 1)
