"""Processes holding GPU device files, found by reading /proc (no NVML, no command).

Before a restart, a process of the previous attempt that still holds /dev/nvidiaN keeps the GPU's
memory and makes the new ranks fail; one stuck in state D (uninterruptible, inside the driver)
cannot be killed at all and needs a GPU reset or reboot. /proc shows both even when NVML hangs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

GPU_DEVICE = re.compile(r"^/dev/nvidia(\d+|ctl|-uvm|-uvm-tools|-modeset)$")


@dataclass(frozen=True, slots=True)
class Holder:
    """One process with GPU device files open."""

    pid: int
    comm: str
    state: str
    """Kernel state letter: R running, S sleeping, D uninterruptible, Z zombie, T stopped..."""
    devices: tuple[str, ...]

    def to_payload(self) -> dict[str, object]:
        return {"pid": self.pid, "comm": self.comm, "state": self.state, "devices": list(self.devices)}


def gpu_holders(
    proc: Path = Path("/proc"), device: re.Pattern[str] = GPU_DEVICE, exclude: frozenset[int] = frozenset()
) -> tuple[list[Holder], int]:
    """Holders of files matching `device`, and how many processes could not be inspected."""
    holders, unreadable = [], 0
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except (PermissionError, FileNotFoundError, NotADirectoryError):
            unreadable += 1
            continue
        devices = set()
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed while we looked
            if device.match(target):
                devices.add(target)
        if devices:
            comm, state = _comm_and_state(entry)
            holders.append(Holder(pid=int(entry.name), comm=comm, state=state, devices=tuple(sorted(devices))))
    return sorted(holders, key=lambda h: h.pid), unreadable


def _comm_and_state(entry: Path) -> tuple[str, str]:
    try:
        stat = (entry / "stat").read_text()
    except OSError:
        return "?", "?"
    # "pid (comm) S ...": comm may contain spaces and parentheses, so split at the last ")".
    head, _, tail = stat.rpartition(")")
    return head.partition("(")[2], tail.split()[0] if tail.split() else "?"
