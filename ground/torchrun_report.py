"""Reading a torchrun agent's failure report: which ranks failed, with what exit code or signal.

When a worker fails, the agent prints a ChildFailedError summary (torch/distributed/elastic/multiprocessing/
errors: `rank : 3 (local_rank: 1)` / `exitcode : -9 (pid: 4242)`, a negative code being a signal). The
launcher is not the workers' parent, so this report is where their exit statuses come from. It is only
ever matched as text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    rank: int
    local_rank: int
    pid: int
    exit_code: int | None
    signal: int | None


def parse_failures(lines: list[str]) -> list[WorkerFailure]:
    out: list[WorkerFailure] = []
    rank: tuple[int, int] | None = None
    for line in lines:
        # torchrun prefixes its log lines ("[rank0]:", timestamps) in some modes; the fields follow.
        text = line.split("]:", 1)[-1] if line.lstrip().startswith("[") and "]:" in line else line
        if m := RANK.match(text):
            rank = (int(m.group(1)), int(m.group(2)))
        elif (m := EXIT.match(text)) and rank is not None:
            code = int(m.group(1))
            out.append(WorkerFailure(rank=rank[0], local_rank=rank[1], pid=int(m.group(2)),
                                     exit_code=None if code < 0 else code, signal=-code if code < 0 else None))
            rank = None
    seen: set[int] = set()
    return [f for f in out if not (f.rank in seen or seen.add(f.rank))]  # type: ignore[func-returns-value]
