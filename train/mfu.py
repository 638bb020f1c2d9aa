"""Model FLOPs utilisation (MFU): achieved model FLOP/s over the hardware's peak.

MFU is the figure MegaScale (Jiang et al. 2024) reports for training efficiency,
with model FLOPs counted as in PaLM (Chowdhery et al. 2022, appendix B). Model FLOPs
are those the model needs mathematically; recomputed activations are not counted
(that would be hardware FLOPs utilisation), so MFU is comparable across checkpointing
choices.

The peak is the dense (no sparsity) bf16 tensor-core rate from NVIDIA's spec sheets,
looked up by the name CUDA reports; on CPU a short matmul probe stands in for it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

__all__ = [
    "GPU_PEAK_BF16_FLOPS",
    "Peak",
    "flops_per_token",
    "measure_cpu_peak",
    "mfu",
    "peak_from_device_name",
    "resolve_peak",
]

# Dense bf16 tensor-core FLOP/s by a substring of the device name (matched case-
# insensitively). Order matters: the first matching entry wins, so names that contain
# another entry's key ("GH200" contains "H200", "H100 PCIe" contains "H100", "A100"
# contains "A10") come before it.
GPU_PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("GH200", 989.4e12),
    ("H200 NVL", 835.5e12),
    ("H200", 989.4e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835.5e12),
    # "NVIDIA H100 80GB HBM3" is the SXM part.
    ("H100", 989.4e12),
    ("A100", 312e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L40S", 362.05e12),
    ("L4", 121e12),
)
"""(name substring, dense bf16 FLOP/s), first match wins."""


@dataclass(frozen=True, slots=True)
class Peak:
    """Peak FLOP/s of one device, and where the number came from."""

    flops_per_second: float
    """Peak FLOP/s of a single device."""

    source: str
    """Origin: "table:<device name>", "probe:cpu-matmul-fp32" or "config"."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.flops_per_second) and self.flops_per_second > 0):
            raise ValueError(
                "Peak.flops_per_second must be a positive finite number, "
                f"got {self.flops_per_second}"
            )
        if not self.source:
            raise ValueError("Peak.source must name where the peak came from, got an empty string")


def flops_per_token(
    n_params: int, n_layers: int, hidden: int, seq_len: int, window: int | None
) -> float:
    """Model FLOPs per trained token: ``6 * N + 12 * L * h * s_eff``.

    - ``N`` is the parameter count without embeddings. Every weight does one
      multiply-add (2 FLOPs) per token in the forward pass and two in the backward
      pass (gradients w.r.t. activations and w.r.t. weights, 4 FLOPs): 6N.
    - ``12 * L * h * s_eff`` counts the attention score (Q K^T) and value (A V)
      matmuls, 2 * 2 * h * s_eff FLOPs per token and layer forward, times 3 for
      forward + backward. ``s_eff = min(seq_len, window)``; ``window=None`` means
      full causal attention. Like PaLM, the causal mask is not used to halve it.

    Source: PaLM (Chowdhery et al. 2022), appendix B; MegaScale (Jiang et al. 2024),
    section on MFU. Activation recomputation is deliberately not counted: these are
    model FLOPs, not hardware FLOPs.
    """
    sizes = {"n_params": n_params, "n_layers": n_layers, "hidden": hidden, "seq_len": seq_len}
    for name, value in sizes.items():
        if value <= 0:
            raise ValueError(f"flops_per_token: {name} must be > 0, got {value}")
    if window is not None and window <= 0:
        raise ValueError(
            f"flops_per_token: window must be > 0 or None (full attention), got {window}"
        )
    s_eff = seq_len if window is None else min(seq_len, window)
    return 6.0 * n_params + 12.0 * n_layers * hidden * s_eff


def peak_from_device_name(name: str) -> Peak:
    """Look up the dense bf16 peak for a GPU name as ``torch.cuda.get_device_name`` gives it."""
    lowered = name.lower()
    for key, flops in GPU_PEAK_BF16_FLOPS:
        if key.lower() in lowered:
            return Peak(flops_per_second=flops, source=f"table:{name}")
    known = ", ".join(key for key, _ in GPU_PEAK_BF16_FLOPS)
    raise ValueError(
        f"no peak FLOP/s known for GPU {name!r} (known: {known}); set `peak_flops` in the "
        f"config to the device's dense bf16 FLOP/s from its spec sheet"
    )


def measure_cpu_peak(size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an fp32 ``size x size`` matmul in this process, best of ``repeats``.

    Uses the current torch thread count, so it measures what this process can get,
    not the whole machine. One untimed warm-up lets the BLAS library set up first.
    """
    if size <= 0:
        raise ValueError(f"measure_cpu_peak: size must be > 0, got {size}")
    if repeats <= 0:
        raise ValueError(f"measure_cpu_peak: repeats must be > 0, got {repeats}")
    a = torch.randn(size, size, dtype=torch.float32)
    b = torch.randn(size, size, dtype=torch.float32)
    out = torch.empty(size, size, dtype=torch.float32)
    torch.mm(a, b, out=out)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    # A coarse clock could read 0 for a tiny matmul; one nanosecond keeps the rate finite.
    return 2.0 * size**3 / max(best, 1e-9)


# Probe results by thread count: the probe takes a moment and the answer only
# changes if the thread count does.
_CPU_PEAK_CACHE: dict[int, float] = {}


def _cached_cpu_peak() -> float:
    """The CPU probe, run once per process and thread count."""
    threads = torch.get_num_threads()
    if threads not in _CPU_PEAK_CACHE:
        _CPU_PEAK_CACHE[threads] = measure_cpu_peak()
    return _CPU_PEAK_CACHE[threads]


def resolve_peak(device: torch.device, configured: float | None) -> Peak:
    """Peak FLOP/s per device: the configured value, else the GPU table, else a CPU probe.

    ``configured`` is ``None`` for automatic detection; otherwise it must be a
    positive finite number and is used as is.
    """
    if configured is not None:
        if not (math.isfinite(configured) and configured > 0):
            raise ValueError(
                f"peak_flops must be a positive finite FLOP/s value or unset, got {configured}"
            )
        return Peak(flops_per_second=float(configured), source="config")
    if device.type == "cuda":
        return peak_from_device_name(torch.cuda.get_device_name(device))
    if device.type == "cpu":
        return Peak(flops_per_second=_cached_cpu_peak(), source="probe:cpu-matmul-fp32")
    raise ValueError(
        f"no way to find the peak FLOP/s of a {device.type!r} device; "
        "set `peak_flops` in the config"
    )


def mfu(tokens_per_second: float, flops_per_token: float, n_devices: int, peak: Peak) -> float:
    """Fraction of the devices' combined peak spent on model FLOPs.

    ``tokens_per_second`` is the global rate over all ``n_devices`` devices.
    """
    if tokens_per_second < 0 or not math.isfinite(tokens_per_second):
        raise ValueError(
            f"mfu: tokens_per_second must be a finite number >= 0, got {tokens_per_second}"
        )
    if flops_per_token <= 0 or not math.isfinite(flops_per_token):
        raise ValueError(
            f"mfu: flops_per_token must be a positive finite number, got {flops_per_token}"
        )
    if n_devices < 1:
        raise ValueError(f"mfu: n_devices must be >= 1, got {n_devices}")
    return tokens_per_second * flops_per_token / (n_devices * peak.flops_per_second)
