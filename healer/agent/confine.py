"""Where a start order may point the ranks: inside the run directory its agent was started for. Whoever holds the
job's token could otherwise have a host's ranks write checkpoints anywhere its user may write, or load one (a
pickle: code) from anywhere it may read.

- `run_dir` must be the agent's run directory or under it;
- `resume`, when a path (not None, "auto" or "none"), must be under it too;
- `config` (megaheal's trainer) must be under it or under the agent's own directory of work (its `cwd`: the
  checkout, whose configs/ hold the shipped configs). A config from elsewhere is copied into the run directory by
  the healer before its first order (healer/runner/build.py), so every host reads the same file.

Paths are taken as the ranks would take them: relative to where they run, links resolved (os.path.realpath), so
neither `..` nor a link leads out. NOTE: a user's program (`program`) is left free: its script and its `cwd` are the
user's own choice, made where `megaheal run` was started, and run as that user anyway; so are `overrides`, which are
settings of the trainer, not paths the agent can tell apart.
"""

from __future__ import annotations

import os
from pathlib import Path

from wire.orders import StartOrder

RESUME_WORDS = frozenset({"auto", "none"})


class OutsideRunDir(ValueError):
    """A start order names a path outside the agent's run directory; `field` names which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def check_start(order: StartOrder, run_dir: Path, cwd: Path) -> None:
    """OutsideRunDir, naming the field, unless every path of `order` is where it may be (see the module's
    docstring); `run_dir`: the agent's run directory, `cwd`: its own directory of work."""
    root = os.path.realpath(run_dir)
    ranks_cwd = Path(order.program.cwd) if order.program is not None else cwd

    def resolved(value: str) -> str:
        return os.path.realpath(ranks_cwd / value)

    if not _inside(resolved(order.run_dir), (root,)):
        raise OutsideRunDir("run_dir", f"{order.run_dir} is not this agent's run directory {root} (nor under it)")
    if order.resume is not None and order.resume not in RESUME_WORDS and not _inside(resolved(order.resume), (root,)):
        raise OutsideRunDir("resume", f"{order.resume} is not under this agent's run directory {root}")
    if order.config is not None:
        checkout = os.path.realpath(cwd)
        if not _inside(resolved(order.config), (root, checkout)):
            raise OutsideRunDir("config", f"{order.config} is neither under this agent's run directory {root} nor "
                                          f"under its checkout {checkout}")
