"""A fake NVML module for gpu_health tests: it answers the pynvml calls the check makes.

Devices are plain records with the values and types NVML returns (strings for name/UUID, an
object with `busId` for PCI info, ints for counters, a 4-tuple for remapped rows, field-value
structs with nvmlReturn/valueType/value). Constants and exception classes are pynvml's own, so an
unsupported query raises the real `pynvml.NVMLError_NotSupported`.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pynvml

NOT_SUPPORTED = "not_supported"

H200 = {
    "name": "NVIDIA H200",
    "uuid": "GPU-3c9e0f52-7a41-4d2b-9b6e-5f0a8c1d2e34",
    "bus_id": "00000000:19:00.0",
    "temperature": 38,
    "slowdown_threshold": 90,
    "ecc_dbe_volatile": 0,
    "ecc_sbe_volatile": 0,
    "remapped_rows": (0, 0, 0, 0),
    "clock_event_reasons": pynvml.nvmlClocksEventReasonGpuIdle,
    "recovery_action": pynvml.NVML_GPU_RECOVERY_ACTION_NONE,
}


def h200(**changes: Any) -> dict[str, Any]:
    """An H200 record with `changes` applied."""
    record = copy.deepcopy(H200)
    record.update(changes)
    return record


class FakeNvml:
    def __init__(self, devices: list[dict[str, Any]], init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.initialised = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(pynvml, name)  # constants and NVMLError classes

    def _value(self, handle: int, key: str) -> Any:
        device = self.devices[handle]
        if device.get("lost"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        value = device[key]
        if value == NOT_SUPPORTED:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._value(h, "name")

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._value(h, "uuid")

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self._value(h, "bus_id"))

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._value(h, "temperature")

    def nvmlDeviceGetTemperatureThreshold(self, h: int, kind: int) -> int:
        assert kind == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return self._value(h, "slowdown_threshold")

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter: int) -> int:
        assert counter == pynvml.NVML_VOLATILE_ECC
        return self._value(
            h, "ecc_dbe_volatile" if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "ecc_sbe_volatile"
        )

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self._value(h, "remapped_rows")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._value(h, "clock_event_reasons")

    def nvmlDeviceGetFieldValues(self, h: int, field_ids: list[int]) -> list[Any]:
        assert field_ids == [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        value = self._value(h, "recovery_action")
        if value is None:  # a driver older than 570 answers the call but not the field
            return [SimpleNamespace(nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED, valueType=0, value=None)]
        return [
            SimpleNamespace(
                nvmlReturn=pynvml.NVML_SUCCESS,
                valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                value=SimpleNamespace(uiVal=value, ullVal=value),
            )
        ]
