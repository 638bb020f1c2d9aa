"""A process frozen in the kernel: the cgroup v1 freezer.

A frozen task sleeps uninterruptibly (state D) and even SIGKILL waits until it is thawed: that is how
a rank stuck in a driver or on a dead mount behaves, and what SIGSTOP (state T, killable) is not.
Frozen groups live under one parent cgroup (the bed's is named with its prefix; a test's or a chaos run's its own),
so teardown finds them all.
"""

from __future__ import annotations

import errno
import re
import time
from pathlib import Path

from testbed.cmd import BedError
from testbed.layout import FREEZER_ROOT

NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,40}$")


def _require() -> None:
    if not (FREEZER_ROOT / "tasks").exists():
        raise BedError(f"the cgroup v1 freezer is not mounted at {FREEZER_ROOT}; cannot freeze processes",
                       permanent=True)


def freeze(root: Path, pids: list[int], name: str, timeout_s: float = 5.0) -> Path:
    """Freeze `pids` in the group `name` under `root` (a cgroup under FREEZER_ROOT); returns the group. The tasks are
    in state D when it returns."""
    _require()
    if not NAME.match(name):
        raise ValueError(f"freezer group name must be lower-case letters, digits, '-' or '_', got {name!r}")
    if not pids:
        raise ValueError("freeze needs at least one pid")
    group = root / name
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


def _empty(group: Path, timeout_s: float = 10.0) -> None:
    """Hand the group's tasks back to the root group and remove it. NOTE: a thawed task with a SIGKILL pending is
    still listed (and the group busy) while the kernel tears it down: retried until it is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        for tid in (group / "tasks").read_text().split():
            try:
                (FREEZER_ROOT / "tasks").write_text(tid)
            except ProcessLookupError:
                pass  # it exited once thawed
        try:
            group.rmdir()
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def groups(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def frozen_pids(root: Path) -> dict[str, list[int]]:
    """The pids of each freezer group under `root`."""
    return {g.name: [int(p) for p in (g / "tasks").read_text().split()] for g in groups(root)}


def remove_all(root: Path) -> list[str]:
    """Thaw every group under `root`, hand its tasks back to the root group, and remove the groups and `root`."""
    removed = []
    for group in groups(root):
        thaw(group)
        _empty(group)
        removed.append(group.name)
    if root.is_dir():
        root.rmdir()
    return removed
