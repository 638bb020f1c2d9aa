"""The GPU Xid codes megaheal acts on (NVIDIA's Xid catalogue and DCGM's health watches): one set, read by the
fault catalogue (healer/decide/catalogue.py), the gpu_fault detector, the gpu_health runbook and the GPU dashboard."""

from __future__ import annotations

CRITICAL_XIDS: tuple[int, ...] = (46, 48, 62, 64, 74, 79, 95, 119, 120, 140)
"""The GPU must leave the job: 46 GPU stopped processing, 48 double-bit ECC, 62 internal micro-controller halt,
64 row-remapper failure, 74 NVLink error, 79 fallen off the bus, 95 uncontained ECC, 119/120 GSP RPC timeout and
GSP error, 140 unrecovered ECC. NVIDIA answers each with a GPU reset or a drain; DCGM's health watch fails on them."""
DEGRADED_XIDS: tuple[int, ...] = (63, 92, 94)
"""Worth a trend, not an eviction: 63 row remap recorded (a reset applies it), 92 high single-bit ECC rate,
94 contained ECC error (only the application that touched the page died)."""
