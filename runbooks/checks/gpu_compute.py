"""`gpu_compute`: on each GPU, a matmul checked against a float64 CPU reference (catches silent
data corruption), its bf16 TFLOP/s against the spec-sheet peak, and a pattern memory test.

`torch.cuda` and the matmul are constructor arguments so tests can run the arithmetic on CPU and
inject a corrupting matmul; without CUDA the check is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runbooks.baselines import BaselineStore, below_baseline
from runbooks.registry import Check, CheckContext
from wire.verdict import CheckResult, Measurement, Status, Suspect, worst

MiB = 1 << 20
NVIDIA_DRIVER = "/proc/driver/nvidia/version"


class GpuComputeCheck(Check):
    name = "gpu_compute"

    @dataclass(kw_only=True, slots=True)
    class Config:
        check_size: int = 1024
        """Matrix size of the correctness check (the float64 CPU reference costs 2 n^3 FLOPs)."""
        check_repeats: int = 3
        """Times the correctness matmul is recomputed and compared (faults can be intermittent)."""
        tolerance: float = 1e-4
        """Largest relative error (max |C - R| / max |R|) of the float32 matmul, TF32 off."""
        perf_size: int = 8192
        """Matrix size of the bf16 throughput measurement."""
        perf_iters: int = 20
        """Timed bf16 matmuls."""
        min_peak_fraction: float = 0.5
        """Degraded below this fraction of the GPU's dense bf16 peak (train.mfu's table)."""
        baseline_fraction: float = 0.9
        """Degraded below this fraction of the stored TFLOP/s baseline."""
        memtest_mib: int = 1024
        """MiB written with two complementary patterns and read back; 0 skips it."""
        gpus: list[int] | None = None
        """GPU indices to check; None: all."""

        def __post_init__(self) -> None:
            if not 64 <= self.check_size <= 4096 or not 256 <= self.perf_size <= 32768:
                raise ValueError(
                    f"check_size must be in [64, 4096] and perf_size in [256, 32768], "
                    f"got {self.check_size}, {self.perf_size}"
                )
            if self.check_repeats < 1 or self.perf_iters < 1:
                raise ValueError(
                    f"check_repeats and perf_iters must be >= 1, got {self.check_repeats}, {self.perf_iters}"
                )
            if not 0 < self.tolerance < 1:
                raise ValueError(f"tolerance must be in (0, 1), got {self.tolerance}")
            for name in ("min_peak_fraction", "baseline_fraction"):
                if not 0 < getattr(self, name) <= 1:
                    raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
            if not 0 <= self.memtest_mib <= 1 << 20:
                raise ValueError(f"memtest_mib must be in [0, 1 TiB in MiB], got {self.memtest_mib}")

    def __init__(self, cuda: Any = None, matmul: Callable[[Any, Any], Any] | None = None) -> None:
        self._cuda = cuda
        self._matmul = matmul

    def run(self, config: Config, ctx: CheckContext) -> CheckResult:
        if self._cuda is None and not Path(NVIDIA_DRIVER).exists():
            # Without the driver torch.cuda cannot work; say so without paying for `import torch`.
            return CheckResult(status=Status.SKIPPED, summary=f"no NVIDIA driver loaded ({NVIDIA_DRIVER} absent)")
        import torch

        cuda = self._cuda if self._cuda is not None else torch.cuda
        if not cuda.is_available() or cuda.device_count() == 0:
            return CheckResult(
                status=Status.SKIPPED,
                summary=f"no CUDA device visible to torch {torch.__version__} "
                f"(CUDA {torch.version.cuda or 'not built in'})",
            )
        indices = [i for i in range(cuda.device_count()) if config.gpus is None or i in config.gpus]
        if not indices:
            return CheckResult(status=Status.SKIPPED, summary=f"no GPU selected among {cuda.device_count()}")
        store = BaselineStore(None if ctx.calibrate else ctx.baselines_path)
        parts = [self._one_gpu(torch.device("cuda", i), cuda, config, ctx, store) for i in indices]
        status = worst([p.status for p in parts])
        bad = [p.summary for p in parts if p.status is not Status.PASS]
        return CheckResult(
            status=status,
            summary="; ".join(bad or [p.summary for p in parts]),
            suspects=tuple(s for p in parts for s in p.suspects),
            measurements=tuple(m for p in parts for m in p.measurements),
        )

    def _one_gpu(self, device: Any, cuda: Any, config: Config, ctx: CheckContext, store: BaselineStore) -> CheckResult:
        from train.mfu import peak_from_device_name

        name = cuda.get_device_name(device)
        labels = {"gpu": str(device.index), "modelName": name, "hostname": ctx.hostname}
        errors = [
            reference_error(device, config.check_size, seed=i, matmul=self._matmul) for i in range(config.check_repeats)
        ]
        bad_bits = memtest(device, config.memtest_mib * MiB) if config.memtest_mib else 0
        tflops = measure_tflops(device, config.perf_size, config.perf_iters, cuda) / 1e12
        key = f"gpu/{name}/bf16_matmul_tflops"
        perf = Measurement(
            name="matmul_tflops",
            value=tflops,
            unit="TFLOP/s",
            labels={**labels, "dtype": "bf16"},
            baseline=store.get(key),
            key=key,
        )
        measurements = (
            perf,
            Measurement(name="matmul_max_rel_error", value=max(errors), unit="ratio", labels=labels),
            Measurement(name="memtest_mismatches", value=float(bad_bits), unit="words", labels=labels),
        )
        problems, status = [], Status.PASS
        if max(errors) > config.tolerance:
            status = Status.FAIL
            problems.append(
                f"matmul differs from the float64 reference by {max(errors):.2e} > {config.tolerance:g} "
                "(silent data corruption)"
            )
        if bad_bits:
            status = Status.FAIL
            problems.append(f"memory test: {bad_bits} word(s) read back wrong")
        try:
            peak = peak_from_device_name(name).flops_per_second / 1e12
        except ValueError:
            peak = None
        if peak is not None and tflops < config.min_peak_fraction * peak:
            status = worst([status, Status.DEGRADED])
            problems.append(f"bf16 matmul {tflops:.0f} TFLOP/s < {config.min_peak_fraction:g} x peak {peak:.0f}")
        elif below_baseline(perf.value, perf.baseline, config.baseline_fraction):
            status = worst([status, Status.DEGRADED])
            problems.append(
                f"bf16 matmul {tflops:.0f} TFLOP/s < {config.baseline_fraction:g} x baseline {perf.baseline:.0f}"
            )
        of_peak = f" ({tflops / peak:.0%} of peak)" if peak else " (peak unknown)"
        text = f"GPU {device.index} ({name}): " + (
            "; ".join(problems) if problems else f"matmul matches reference, {tflops:.0f} TFLOP/s bf16{of_peak}"
        )
        suspects = (
            (Suspect(kind="gpu", name=f"{ctx.hostname}/{device.index}", reason="; ".join(problems)),)
            if problems
            else ()
        )
        return CheckResult(status=status, summary=text, suspects=suspects, measurements=measurements)


def reference_error(device: Any, size: int, seed: int, matmul: Callable[[Any, Any], Any] | None = None) -> float:
    """max |C - R| / max |R| of a float32 matmul on `device` against float64 on the CPU (TF32 off)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(size, size, generator=gen, dtype=torch.float32)
    b = torch.randn(size, size, generator=gen, dtype=torch.float32)
    reference = a.double() @ b.double()
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would be a legitimate 1e-3 error, hiding real faults
    try:
        result = (matmul or torch.matmul)(a.to(device), b.to(device)).double().cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    return float((result - reference).abs().max() / reference.abs().max())


def memtest(device: Any, nbytes: int) -> int:
    """Words read back wrong after writing a pattern and its complement over `nbytes` of memory."""
    import torch

    n = nbytes // 4
    index = torch.arange(n, dtype=torch.int32, device=device)
    bad = 0
    for mask in (0x5A5A5A5A, ~0x5A5A5A5A):  # complementary patterns: every bit is written as 0 and as 1
        buf = torch.bitwise_xor(index, mask)
        bad += int((buf != torch.bitwise_xor(index, mask)).sum())
        del buf
    return bad


def measure_tflops(device: Any, size: int, iters: int, cuda: Any) -> float:
    """Dense bf16 matmul FLOP/s on `device`, timed with CUDA events after warm-up."""
    import torch

    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    return 2.0 * size**3 * iters / (start.elapsed_time(end) / 1e3)
