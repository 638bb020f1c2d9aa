"""GPU checks against a fake NVML device and, for the arithmetic, torch on the CPU."""

from __future__ import annotations

from datetime import timedelta

import pynvml
import pytest
import torch

from runbooks.checks.gpu_compute import GpuComputeCheck, memtest, reference_error
from runbooks.checks.gpu_health import GpuHealthCheck
from runbooks.checks.xid_log import XidEvent, parse_kmsg_record
from runbooks.registry import CheckContext
from tests.runbooks.fake_nvml import NOT_SUPPORTED, FakeNvml, h200
from wire.verdict import Status

pytestmark = pytest.mark.unit

CTX = CheckContext(hostname="gpu-node-7")
BUS_1 = "00000000:3B:00.0"


def _run(nvml: FakeNvml, xids: list[XidEvent] | None = None, **config) -> object:
    check = GpuHealthCheck(nvml=nvml, xid_reader=lambda window_s: list(xids or []))
    return check.run(GpuHealthCheck.Config(**config), CTX)


def test_healthy_gpus_pass_with_dcgm_style_labels() -> None:
    nvml = FakeNvml([h200(), h200(uuid="GPU-other", bus_id=BUS_1)])
    result = _run(nvml)
    assert result.status is Status.PASS and result.suspects == ()
    assert "2 GPU(s) healthy" in result.summary
    temps = [m for m in result.measurements if m.name == "temperature"]
    assert [m.labels["gpu"] for m in temps] == ["0", "1"] and temps[1].labels["pci_bus_id"] == "0000:3b:00"
    assert nvml.initialised == 0, "NVML is shut down after the check"


def test_a_gpu_with_xid_79_dbe_and_a_reboot_request_fails_and_is_named() -> None:
    bad = h200(
        uuid="GPU-bad", bus_id=BUS_1, ecc_dbe_volatile=2, recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    )
    xid = parse_kmsg_record(
        "3,811,9512345678,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, " "GPU has fallen off the bus."
    )
    result = _run(FakeNvml([h200(), bad]), [xid])
    assert result.status is Status.FAIL
    assert [(s.kind, s.name) for s in result.suspects] == [("gpu", "GPU-bad")]
    reason = result.suspects[0].reason
    assert "Xid 79" in reason and "2 uncorrectable (DBE)" in reason and "node reboot" in reason
    assert result.summary.startswith("GPU 1 (NVIDIA H200)")


def test_slowdowns_and_pending_remaps_degrade_and_unsupported_queries_do_not() -> None:
    hot = h200(
        temperature=91, clock_event_reasons=pynvml.nvmlClocksEventReasonHwThermalSlowdown, remapped_rows=(3, 1, 1, 0)
    )
    old_driver = h200(uuid="GPU-old", ecc_dbe_volatile=NOT_SUPPORTED, recovery_action=None)
    result = _run(FakeNvml([hot, old_driver]))
    assert result.status is Status.DEGRADED
    [suspect] = result.suspects
    assert "HW thermal slowdown" in suspect.reason and "91 C >= 90 C" in suspect.reason
    assert "row remap pending" in suspect.reason
    assert result.details["gpus"][1]["unsupported"] == ["ecc_dbe", "recovery_action"]


def test_a_lost_gpu_fails_and_no_nvml_library_skips() -> None:
    result = _run(FakeNvml([h200(), h200(uuid="GPU-lost", lost=True)]))
    assert result.status is Status.FAIL and "GpuIsLost" in result.summary
    skipped = _run(FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert skipped.status is Status.SKIPPED and "NVML unavailable" in skipped.summary
    broken = _run(FakeNvml([], init_error=pynvml.NVML_ERROR_UNKNOWN))
    assert broken.status is Status.ERROR


def test_xid_window_and_unreadable_kernel_log_are_reported() -> None:
    def unreadable(window_s: float) -> list[XidEvent]:
        assert window_s == 7200
        raise PermissionError(1, "Operation not permitted")

    check = GpuHealthCheck(nvml=FakeNvml([h200()]), xid_reader=unreadable)
    result = check.run(GpuHealthCheck.Config(xid_window=timedelta(hours=2)), CTX)
    assert result.status is Status.PASS and "Xid history unavailable (Operation not permitted)" in result.summary


def test_the_reference_matmul_catches_a_corrupted_result() -> None:
    cpu = torch.device("cpu")
    assert reference_error(cpu, 128, seed=0) < 1e-5

    def flipped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = a @ b
        out[17, 42] = -out[17, 42]  # a sign bit flipped in one element
        return out

    assert reference_error(cpu, 128, seed=0, matmul=flipped) > 1e-2
    assert memtest(cpu, 1 << 20) == 0


def test_gpu_compute_skips_without_cuda() -> None:
    class NoCuda:
        @staticmethod
        def is_available() -> bool:
            return False

    result = GpuComputeCheck(cuda=NoCuda()).run(GpuComputeCheck.Config(), CTX)
    assert result.status is Status.SKIPPED and "no CUDA device" in result.summary
