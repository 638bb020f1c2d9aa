"""Processes holding GPU device files, found by reading /proc (no NVML, no command).

Before a restart, a process of the previous attempt that still holds /dev/nvidiaN keeps the GPU's
memory and makes the new ranks fail; one stuck in state D (uninterruptible, inside the driver)
cannot be killed at all and needs a GPU reset or reboot. /proc shows both even when NVML hangs.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from ground import procfs

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


def stuck_ranks(node: str, settle_s: float = 0.5, proc: Path = procfs.PROC) -> list[Holder]:
    """Training ranks of `node` (torchrun's workers: TORCHELASTIC_RUN_ID in their environment; MEGAHEAL_NODE, where
    set, naming this node) in state D now and `settle_s` later, the same processes both times: stuck in the kernel,
    where SIGKILL cannot end them (a hung driver call, a dead mount, a frozen cgroup). A read from disk is in D for
    moments, not for both looks."""
    def in_d() -> dict[int, procfs.Stat]:
        out = {}
        for pid in procfs.pids(proc):
            st = procfs.stat(pid, proc)
            if st is None or st.state != "D":
                continue
            env = procfs.environ(pid)
            if "TORCHELASTIC_RUN_ID" in env and env.get("MEGAHEAL_NODE", node) == node:
                out[pid] = st
        return out

    first = in_d()
    if not first:
        return []
    time.sleep(settle_s)
    return [Holder(pid=pid, comm=st.comm, state="D", devices=()) for pid, st in sorted(in_d().items())
            if pid in first and first[pid].started == st.started]
