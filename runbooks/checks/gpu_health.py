"""`gpu_health`: an NVML snapshot of every GPU turned into a verdict.

Per GPU: Xids in a window (kernel log), volatile double-bit ECC errors, remapped rows (pending,
failed), the driver's recovery action (NVML field 230), clock event reasons, temperature against
the slowdown threshold. The NVML module is an argument (pynvml by default) so tests pass a
recorded fake device; without NVML or without GPUs the check is skipped with the reason.
Which Xids fail or degrade a GPU comes from the fault catalogue (healer.decide.catalogue: NVIDIA's Xid
catalog and DCGM's health watches).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from ground.gpu_faults import CRITICAL_XIDS, DEGRADED_XIDS
from runbooks.checks import xid_log
from runbooks.checks.gpu_snapshot import Snapshot, take_snapshot
from runbooks.registry import Check, CheckContext
from wire.verdict import CheckResult, Measurement, Status, Suspect, worst

log = logging.getLogger(__name__)

RECOVERY_ACTIONS = {
    0: "none",
    1: "GPU reset",
    2: "node reboot",
    3: "drain P2P",
    4: "drain and reset",
    5: "recover IMEX domain",
    6: "bus reset",
    7: "system reboot",
}
# Clock event reason bits that mean the GPU is being slowed by hardware or heat (not by idling or
# the ordinary software power cap).
SLOWDOWN_BITS = {0x8: "HW slowdown", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown", 0x80: "HW power brake"}


class GpuHealthCheck(Check):
    name = "gpu_health"

    @dataclass(kw_only=True, slots=True)
    class Config:
        xid_window: timedelta = timedelta(hours=1)
        """Count Xids logged within this long before the check."""
        # NOTE: the defaults are the fault catalogue's, the one Xid list: gpu-triage fails a GPU on the same codes
        # the healer evicts it for and the Prometheus Xid alert fires on (tests/deploy/test_catalogue_agreement.py).
        fail_xids: list[int] = field(default_factory=lambda: list(CRITICAL_XIDS))
        """Xid codes that fail the GPU (default: the catalogue's critical Xids)."""
        degraded_xids: list[int] = field(default_factory=lambda: list(DEGRADED_XIDS))
        """Xid codes that degrade it (default: the catalogue's degraded Xids)."""
        max_temperature_c: int | None = None
        """Degraded at or above this; None: the GPU's own slowdown threshold (85 C if it has none)."""
        gpus: list[int] | None = None
        """GPU indices to check; None: all."""

        def __post_init__(self) -> None:
            if not timedelta(0) < self.xid_window <= timedelta(days=30):
                raise ValueError(f"xid_window must be in (0, 30 days], got {self.xid_window}")
            if set(self.fail_xids) & set(self.degraded_xids):
                raise ValueError(
                    f"fail_xids and degraded_xids overlap: {sorted(set(self.fail_xids) & set(self.degraded_xids))}"
                )
            if self.max_temperature_c is not None and not 30 <= self.max_temperature_c <= 120:
                raise ValueError(f"max_temperature_c must be in [30, 120], got {self.max_temperature_c}")
            if self.gpus is not None and any(i < 0 for i in self.gpus):
                raise ValueError(f"gpus must be GPU indices >= 0, got {self.gpus}")

    def __init__(self, nvml: Any = None, xid_reader: Callable[[float], list[xid_log.XidEvent]] | None = None) -> None:
        self._nvml = nvml
        self._xid_reader = xid_reader or xid_log.read_kmsg

    def run(self, config: Config, ctx: CheckContext) -> CheckResult:
        nvml = self._nvml
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:
                return CheckResult(status=Status.SKIPPED, summary=f"NVML bindings not installed: {exc}")
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            # No library or no driver: a machine without NVIDIA GPUs. Anything else is a broken driver.
            absent = isinstance(exc, (nvml.NVMLError_LibraryNotFound, nvml.NVMLError_DriverNotLoaded))
            return CheckResult(status=Status.SKIPPED if absent else Status.ERROR, summary=f"NVML unavailable: {exc}")
        try:
            return self._check(nvml, config, ctx)
        finally:
            nvml.nvmlShutdown()

    def _check(self, nvml: Any, config: Config, ctx: CheckContext) -> CheckResult:
        count = nvml.nvmlDeviceGetCount()
        indices = [i for i in range(count) if config.gpus is None or i in config.gpus]
        if not indices:
            return CheckResult(status=Status.SKIPPED, summary=f"no GPU to check (NVML sees {count})")
        xids, xid_note = self._xids(config)
        snapshots = [take_snapshot(nvml, i) for i in indices]
        verdicts = [evaluate(s, [x for x in xids if s.bus and x.bus == s.bus], config) for s in snapshots]
        status = worst([v[0] for v in verdicts])
        suspects = tuple(
            Suspect(kind="gpu", name=s.uuid or str(s.index), reason="; ".join(reasons))
            for s, (st, reasons) in zip(snapshots, verdicts)
            if st is not Status.PASS
        )
        measurements = tuple(m for s in snapshots for m in _measurements(s, ctx.hostname))
        if suspects:
            summary = "; ".join(
                f"GPU {s.index} ({s.name}): {'; '.join(r)}"
                for s, (st, r) in zip(snapshots, verdicts)
                if st is not Status.PASS
            )
        else:
            summary = (
                f"{len(snapshots)} GPU(s) healthy (no Xid in {_hours(config.xid_window)}, no DBE, no row-remap failure)"
            )
        if xid_note:
            summary += f"; {xid_note}"
        details = {
            "gpus": [s.to_payload() for s in snapshots],
            "xids": [{"bus": x.bus, "code": x.code, "message": x.message} for x in xids],
        }
        return CheckResult(
            status=status, summary=summary, suspects=suspects, measurements=measurements, details=details
        )

    def _xids(self, config: Config) -> tuple[list[xid_log.XidEvent], str]:
        try:
            return self._xid_reader(config.xid_window.total_seconds()), ""
        except OSError as exc:
            # Without the kernel log, the other signals (DBE, remap, recovery action) still stand.
            return [], f"Xid history unavailable ({exc.strerror or exc})"


def evaluate(s: Snapshot, xids: list[xid_log.XidEvent], config: GpuHealthCheck.Config) -> tuple[Status, list[str]]:
    """Status of one GPU and the reasons, most severe first."""
    if s.error:
        return Status.FAIL, [f"NVML query failed: {s.error}"]
    fail, degraded = [], []
    codes = sorted({x.code for x in xids})
    if bad := [c for c in codes if c in config.fail_xids]:
        fail.append(f"Xid {', '.join(map(str, bad))} in the last {_hours(config.xid_window)}")
    if warn := [c for c in codes if c in config.degraded_xids]:
        degraded.append(f"Xid {', '.join(map(str, warn))} in the last {_hours(config.xid_window)}")
    if s.dbe_volatile:
        fail.append(f"{s.dbe_volatile} uncorrectable (DBE) ECC error(s) since driver load")
    if s.remap_failure:
        fail.append("row remapping failed (RMA path)")
    elif s.remap_pending:
        degraded.append("row remap pending: needs a GPU reset")
    if s.recovery_action:
        fail.append(f"driver asks for recovery action: {RECOVERY_ACTIONS.get(s.recovery_action, s.recovery_action)}")
    if slow := [name for bit, name in SLOWDOWN_BITS.items() if (s.clock_reasons or 0) & bit]:
        degraded.append("clocks slowed: " + ", ".join(slow))
    limit = config.max_temperature_c or s.slowdown_temp_c or 85
    if s.temperature_c is not None and s.temperature_c >= limit:
        degraded.append(f"temperature {s.temperature_c} C >= {limit} C")
    if fail:
        return Status.FAIL, fail + degraded
    return (Status.DEGRADED, degraded) if degraded else (Status.PASS, [])


def _measurements(s: Snapshot, hostname: str) -> list[Measurement]:
    labels = {
        "gpu": str(s.index),
        "UUID": s.uuid or "",
        "pci_bus_id": s.bus or "",
        "modelName": s.name,
        "hostname": hostname,
    }
    values = {
        "temperature": (s.temperature_c, "C"),
        "ecc_dbe_volatile": (s.dbe_volatile, "errors"),
        "ecc_sbe_volatile": (s.sbe_volatile, "errors"),
        "remapped_rows_uncorrectable": (s.remapped_uncorrectable, "rows"),
        "remapped_rows_correctable": (s.remapped_correctable, "rows"),
        "clock_event_reasons": (s.clock_reasons, "bitmask"),
    }
    return [
        Measurement(name=name, value=float(v), unit=unit, labels=labels)
        for name, (v, unit) in values.items()
        if v is not None
    ]


def _hours(window: timedelta) -> str:
    seconds = window.total_seconds()
    return f"{seconds / 3600:g}h" if seconds >= 3600 else f"{seconds / 60:g}m"
