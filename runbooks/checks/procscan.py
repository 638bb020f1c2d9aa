"""Processes holding GPU device files, found by reading /proc (no NVML, no command).

Before a restart, a process of the previous attempt that still holds /dev/nvidiaN keeps the GPU's
memory and makes the new ranks fail; one stuck in state D (uninterruptible, inside the driver)
cannot be killed at all and needs a GPU reset or reboot. /proc shows both even when NVML hangs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megaheal import procfs

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
    proc: Path = procfs.PROC, device: re.Pattern[str] = GPU_DEVICE, exclude: frozenset[int] = frozenset()
) -> tuple[list[Holder], int]:
    """Holders of files matching `device`, and how many processes could not be inspected."""
    holders, unreadable = [], 0
    for pid in procfs.pids(proc):
        if pid in exclude:
            continue
        files = procfs.open_files(pid, proc)
        if files is None:
            unreadable += 1
            continue
        devices = {f for f in files if device.match(f)}
        st = procfs.stat(pid, proc) if devices else None
        if st is not None:  # None: it left while we looked, and holds nothing now
            holders.append(Holder(pid=pid, comm=st.comm, state=st.state, devices=tuple(sorted(devices))))
    return holders, unreadable
