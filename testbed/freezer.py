"""A process frozen in the kernel: the cgroup v1 freezer.

A frozen task sleeps uninterruptibly (state D) and even SIGKILL waits until it is thawed: that is how
a rank stuck in a driver or on a dead mount behaves, and what SIGSTOP (state T, killable) is not.
The bed's frozen groups live under one cgroup named with its prefix, so teardown finds them all.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from testbed.cmd import BedError
from testbed.layout import FREEZER_ROOT, Layout

NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,40}$")


def _require() -> None:
    if not (FREEZER_ROOT / "tasks").exists():
        raise BedError(f"the cgroup v1 freezer is not mounted at {FREEZER_ROOT}; cannot freeze processes",
                       permanent=True)


def freeze(layout: Layout, pids: list[int], name: str, timeout_s: float = 5.0) -> Path:
    """Freeze `pids` in the group `name`; returns the group. The tasks are in state D when it returns."""
    _require()
    if not NAME.match(name):
        raise ValueError(f"freezer group name must be lower-case letters, digits, '-' or '_', got {name!r}")
    if not pids:
        raise ValueError("freeze needs at least one pid")
    group = layout.freezer / name
    group.mkdir(parents=True, exist_ok=True)
    for pid in pids:
        try:
            (group / "tasks").write_text(str(pid))
        except ProcessLookupError as exc:
            raise BedError(f"cannot freeze pid {pid}: no such process") from exc
    (group / "freezer.state").write_text("FROZEN")
    deadline = time.monotonic() + timeout_s
    while (group / "freezer.state").read_text().strip() != "FROZEN":
        if time.monotonic() > deadline:
            raise BedError(f"freezer group {group} did not reach FROZEN within {timeout_s:g}s")
        time.sleep(0.02)
    return group


def thaw(group: Path) -> None:
    """Let the group's tasks run again (a pending SIGKILL is delivered now)."""
    if (group / "freezer.state").exists():
        (group / "freezer.state").write_text("THAWED")


def groups(layout: Layout) -> list[Path]:
    return sorted(p for p in layout.freezer.iterdir() if p.is_dir()) if layout.freezer.is_dir() else []


def frozen_pids(layout: Layout) -> dict[str, list[int]]:
    """The pids of each of the bed's freezer groups."""
    return {g.name: [int(p) for p in (g / "tasks").read_text().split()] for g in groups(layout)}


def remove_all(layout: Layout) -> list[str]:
    """Thaw every group of the bed, hand its tasks back to the root group, and remove the groups."""
    removed = []
    for group in groups(layout):
        thaw(group)
        for pid in (group / "tasks").read_text().split():
            try:
                (FREEZER_ROOT / "tasks").write_text(pid)
            except ProcessLookupError:
                pass  # it exited once thawed
        group.rmdir()
        removed.append(group.name)
    if layout.freezer.is_dir():
        layout.freezer.rmdir()
    return removed
