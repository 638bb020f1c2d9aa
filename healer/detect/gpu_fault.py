"""`gpu_fault`: GPUs that must leave the job, from the NVML data in the sidecars' heartbeats, one finding per
(node, GPU).

A GPU is faulty when any of these holds: a critical Xid was counted (the fault catalogue's CRITICAL_XIDS by
default: 79 fell off the bus, 48 double-bit ECC, 95 uncontained ECC, 64 row-remapper failure, 74 NVLink, ...);
volatile double-bit ECC errors; a failed row remap; a pending remap (needs a GPU reset); or the driver asks for a
recovery action (reset, reboot, drain). Healthy when the node's latest batch shows the GPU with none of them; a
node without NVML ("absent") says nothing either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ground.gpu_faults import CRITICAL_XIDS
from healer.detect.base import Detector, Evaluation, Finding, LazyKeys
from healer.detect.suspects import Suspect
from healer.observe.heartbeats import gpu_flagged
from healer.observe.jobview import Readings
from wire.telemetry import GpuEntry

RECOVERY_ACTIONS = {1: "GPU reset", 2: "node reboot", 3: "drain P2P", 4: "drain and reset"}


class GpuFault(Detector):
    name = "gpu_fault"

    @dataclass(kw_only=True, slots=True)
    class Config:
        xids: tuple[int, ...] = CRITICAL_XIDS
        """Xid codes that take a GPU out of the job."""
        remap_pending: bool = True
        """Whether a pending row remap (fixed by a GPU reset) counts as a fault."""

        def __post_init__(self) -> None:
            if not self.xids or any(x <= 0 for x in self.xids):
                raise ValueError(f"xids must be positive Xid codes, got {list(self.xids)}")

    config: Config

    def faults(self, gpu: GpuEntry) -> list[str]:
        """Pure: why this GPU entry is faulty (empty: healthy)."""
        if not gpu_flagged(gpu):
            return []
        why = []
        for code in self.config.xids:
            n = gpu.xid_counts.get(str(code), 0)
            if n > 0:
                why.append(f"Xid {code} x{n}")
        if _positive(gpu.ecc_dbe_volatile):
            why.append(f"{gpu.ecc_dbe_volatile:g} uncorrectable (double-bit) ECC errors")
        if _positive(gpu.row_remap_failure):
            why.append("row remapping failed")
        if self.config.remap_pending and _positive(gpu.row_remap_pending):
            why.append("row remap pending (needs a GPU reset)")
        action = gpu.recovery_action
        if action is not None and _positive(action):
            why.append(f"driver asks for recovery: {RECOVERY_ACTIONS.get(int(action), f'action {action:g}')}")
        return why

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        firing, healthy = [], set()
        nodes = table.nodes()
        for node in nodes:
            if not node.gpus_flagged:
                continue  # NOTE: nearly every node, every cycle (16,384 of them at scale): one test, not one per GPU
            for gpu in node.gpus:
                key = f"{node.node}/gpu{gpu.gpu}"
                why = self.faults(gpu)
                if not why:
                    healthy.add(key)
                    continue
                job = node.jobs[0] if len(node.jobs) == 1 else None
                firing.append(Finding(
                    key=key, job=job, node=node.node,
                    summary=f"GPU {gpu.gpu} on {node.node} is faulty: {'; '.join(why)}",
                    evidence={"gpu": msgspec.to_builtins(gpu), "reasons": why, "jobs": list(node.jobs)},
                    labels={"gpu": str(gpu.gpu), "suspect_node": node.node},
                    suspects=(Suspect(node=node.node, gpu=gpu.gpu),)))
        # Healthy: every GPU of a node without a flagged one, and the flagged nodes' GPUs found healthy above.
        return Evaluation(firing=tuple(firing), healthy=LazyKeys(
            lambda: healthy.union(f"{n.node}/gpu{g.gpu}" for n in nodes if not n.gpus_flagged for g in n.gpus)))


def _positive(value: float | None) -> bool:
    return value is not None and value > 0
