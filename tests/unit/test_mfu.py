"""Tests for train.mfu: the PaLM/MegaScale FLOPs formula, the peak table and MFU arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from train import mfu as mfu_module
from train.mfu import (
    Peak,
    flops_per_token,
    measure_cpu_peak,
    mfu,
    peak_from_device_name,
    resolve_peak,
)

pytestmark = pytest.mark.unit

# GPT-3 175B (Brown et al. 2020, table 2.1).
GPT3_LAYERS = 96
GPT3_HIDDEN = 12288
GPT3_SEQ = 2048
GPT3_VOCAB = 50257


def test_flops_per_token_matches_gpt3_175b() -> None:
    n_non_embedding = 12 * GPT3_LAYERS * GPT3_HIDDEN**2
    assert n_non_embedding == pytest.approx(1.7395e11, rel=1e-4)
    published_minus_embedding = 175e9 - GPT3_VOCAB * GPT3_HIDDEN
    assert n_non_embedding == pytest.approx(published_minus_embedding, rel=0.01)

    expected = 6 * n_non_embedding + 12 * GPT3_LAYERS * GPT3_HIDDEN * GPT3_SEQ
    got = flops_per_token(n_non_embedding, GPT3_LAYERS, GPT3_HIDDEN, GPT3_SEQ, None)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got == pytest.approx(1.07e12, rel=0.01)


def test_sliding_window_reduces_only_the_attention_term() -> None:
    n, layers, hidden, seq = 1_000_000, 4, 256, 4096
    full = flops_per_token(n, layers, hidden, seq, None)
    windowed = flops_per_token(n, layers, hidden, seq, 1024)
    assert full - windowed == pytest.approx(12 * layers * hidden * (seq - 1024))
    assert windowed - 6 * n == pytest.approx(12 * layers * hidden * 1024)
    # A window wider than the sequence changes nothing.
    assert flops_per_token(n, layers, hidden, seq, 8192) == full


@pytest.mark.parametrize(
    "args",
    [
        (0, 1, 1, 1, None),
        (1, 0, 1, 1, None),
        (1, 1, 0, 1, None),
        (1, 1, 1, 0, None),
        (1, 1, 1, 1, 0),
    ],
)
def test_flops_per_token_rejects_non_positive_sizes(
    args: tuple[int, int, int, int, int | None],
) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        flops_per_token(*args)


def test_mfu_arithmetic() -> None:
    peak = Peak(flops_per_second=1e15, source="config")
    # 8 devices at 1e15 FLOP/s; 4e3 tokens/s at 1e12 FLOPs/token is 4e15 FLOP/s: 50%.
    assert mfu(4e3, 1e12, 8, peak) == pytest.approx(0.5)
    assert mfu(0.0, 1e12, 8, peak) == 0.0
    with pytest.raises(ValueError, match="n_devices"):
        mfu(1.0, 1.0, 0, peak)
    with pytest.raises(ValueError, match="flops_per_token"):
        mfu(1.0, 0.0, 1, peak)


@pytest.mark.parametrize(
    ("name", "flops"),
    [
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10G", 125e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA B200", 2.25e15),
    ],
)
def test_table_lookup(name: str, flops: float) -> None:
    peak = peak_from_device_name(name)
    assert peak.flops_per_second == flops
    assert peak.source == f"table:{name}"


def test_unknown_gpu_is_an_error_naming_peak_flops() -> None:
    with pytest.raises(ValueError, match="peak_flops"):
        peak_from_device_name("NVIDIA GeForce GTX 1080")


def test_resolve_peak_on_cuda_uses_the_device_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU is needed: only the reported name matters.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    peak = resolve_peak(torch.device("cuda", 0), None)
    assert peak == Peak(flops_per_second=989.4e12, source="table:NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU")
    with pytest.raises(ValueError, match="peak_flops"):
        resolve_peak(torch.device("cuda", 0), None)


def test_configured_peak_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    configured = Peak(flops_per_second=5e14, source="config")
    assert resolve_peak(torch.device("cuda", 0), 5e14) == configured
    assert resolve_peak(torch.device("cpu"), 1e12) == Peak(flops_per_second=1e12, source="config")
    with pytest.raises(ValueError, match="peak_flops"):
        resolve_peak(torch.device("cpu"), -1.0)


def test_cpu_probe_returns_a_positive_finite_rate() -> None:
    rate = measure_cpu_peak(size=64, repeats=2)
    assert rate > 0 and math.isfinite(rate)


def test_cpu_peak_is_probed_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fake_probe(size: int = 1024, repeats: int = 5) -> float:
        calls.append(size)
        return 3e10

    monkeypatch.setattr(mfu_module, "_CPU_PEAK_CACHE", {})
    monkeypatch.setattr(mfu_module, "measure_cpu_peak", fake_probe)
    first = resolve_peak(torch.device("cpu"), None)
    second = resolve_peak(torch.device("cpu"), None)
    assert first == second == Peak(flops_per_second=3e10, source="probe:cpu-matmul-fp32")
    assert len(calls) == 1


def test_peak_rejects_non_positive_values() -> None:
    with pytest.raises(ValueError, match="flops_per_second"):
        Peak(flops_per_second=0.0, source="config")
