"""One GPU's health-relevant NVML state, read query by query.

A query the GPU does not support (ECC on a consumer card, field 230 before driver 570) leaves
its value None and is listed in `unsupported`; any other NVML error means the GPU cannot be read
(e.g. it fell off the bus) and is recorded as the snapshot's `error`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from runbooks.checks.xid_log import normalise_bus


@dataclass(slots=True)
class Snapshot:
    index: int
    name: str = "?"
    uuid: str | None = None
    bus: str | None = None
    """PCI bus normalised to the kernel log's form, "0000:3b:00"."""
    temperature_c: int | None = None
    slowdown_temp_c: int | None = None
    dbe_volatile: int | None = None
    sbe_volatile: int | None = None
    remapped_correctable: int | None = None
    remapped_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    recovery_action: int | None = None
    clock_reasons: int | None = None
    unsupported: list[str] = field(default_factory=list)
    error: str | None = None

    def to_payload(self) -> dict[str, Any]:
        return asdict(self)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def take_snapshot(nvml: Any, index: int) -> Snapshot:
    snap = Snapshot(index=index)
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        snap.name = _text(nvml.nvmlDeviceGetName(handle))
        snap.uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        snap.bus = normalise_bus(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
        _read_all(nvml, handle, snap)
    except nvml.NVMLError as exc:
        snap.error = f"{type(exc).__name__}: {exc}"
    return snap


def _read_all(nvml: Any, handle: Any, snap: Snapshot) -> None:
    def query(name: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(handle, *args)
        except nvml.NVMLError_NotSupported:
            snap.unsupported.append(name)
            return None

    snap.temperature_c = query("temperature", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
    snap.slowdown_temp_c = query(
        "slowdown_threshold", nvml.nvmlDeviceGetTemperatureThreshold, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    )
    snap.dbe_volatile = query(
        "ecc_dbe", nvml.nvmlDeviceGetTotalEccErrors, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
    )
    snap.sbe_volatile = query(
        "ecc_sbe", nvml.nvmlDeviceGetTotalEccErrors, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC
    )
    remap = query("remapped_rows", nvml.nvmlDeviceGetRemappedRows)
    if remap is not None:
        corr, unc, pending, failure = remap
        snap.remapped_correctable, snap.remapped_uncorrectable = int(corr), int(unc)
        snap.remap_pending, snap.remap_failure = bool(pending), bool(failure)
    snap.clock_reasons = query("clock_event_reasons", nvml.nvmlDeviceGetCurrentClocksEventReasons)
    values = query("recovery_action", nvml.nvmlDeviceGetFieldValues, [nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    if values is not None:
        v = values[0]
        if v.nvmlReturn == nvml.NVML_SUCCESS:
            snap.recovery_action = int(
                v.value.ullVal if v.valueType == nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG else v.value.uiVal
            )
        else:
            snap.unsupported.append("recovery_action")  # field 230 needs driver >= 570
