"""A recorded NVML: answers the pynvml calls the NVML collector and the Xid watcher make, from a fixture.

It has pynvml's own constants and error classes (nvidia-ml-py is installed everywhere; only the
driver is missing), so the collector cannot tell it from the real module. Tests can make any call
answer NotSupported, for every GPU or one, and can queue Xid events for the event set.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvml"
DCGM_SAMPLE = FIXTURES / "dcgm_sample_h100_a100.json"

_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class _Answers(dict):
    """A GPU's recorded answers; one recorded as "NotSupported" (or "NVMLError N") raises it when read."""

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        if isinstance(value, dict):
            return _Answers(value)
        if isinstance(value, str) and value == "NotSupported":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if isinstance(value, str) and value.startswith("NVMLError "):
            raise pynvml.NVMLError(int(value.split()[1]))
        return value

    def values_dict(self) -> dict[str, Any]:
        return {k: self[k] for k in self}


@dataclass(frozen=True)
class Handle:
    index: int


class RecordedNvml:
    NVMLError = pynvml.NVMLError

    def __init__(self, path: Path = DCGM_SAMPLE) -> None:
        recording = json.loads(path.read_text())
        self.gpus: list[dict[str, Any]] = recording["gpus"]
        self.driver_version: str = recording.get("driver_version", "NotSupported")
        self.calls: Counter[str] = Counter()
        self._unsupported: set[tuple[str, int | None]] = set()
        self._events: deque[tuple[int, int]] = deque()
        self._registered: set[int] = set()
        # Every constant the collector may look up, from the real bindings.
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlEventType", "nvmlClocks")):
                setattr(self, name, getattr(pynvml, name))

    # ------------------------------------------------------------ test controls

    def not_supported(self, call: str, gpu: int | None = None) -> None:
        """Make `call` raise NVMLError_NotSupported, on every GPU (gpu=None) or on one."""
        self._unsupported.add((call, gpu))

    def inject_xid(self, gpu: int, xid: int) -> None:
        self._events.append((gpu, xid))

    def _gpu(self, call: str, handle: Handle) -> _Answers:
        self.calls[call] += 1
        if (call, None) in self._unsupported or (call, handle.index) in self._unsupported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _Answers(self.gpus[handle.index])


    # ------------------------------------------------------------ identity

    def nvmlSystemGetDriverVersion(self) -> str:
        self.calls["nvmlSystemGetDriverVersion"] += 1
        return _Answers(driver=self.driver_version)["driver"]

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        return Handle(index)

    def nvmlDeviceGetIndex(self, handle: Handle) -> int:
        return handle.index

    def nvmlDeviceGetUUID(self, h: Handle) -> str:
        return self._gpu("nvmlDeviceGetUUID", h)["uuid"]

    def nvmlDeviceGetName(self, h: Handle) -> str:
        return self._gpu("nvmlDeviceGetName", h)["name"]

    def nvmlDeviceGetPciInfo(self, h: Handle) -> SimpleNamespace:
        return SimpleNamespace(busId=self._gpu("nvmlDeviceGetPciInfo", h)["pci_bus_id"].encode())

    def nvmlDeviceGetMinorNumber(self, h: Handle) -> int:
        return self._gpu("nvmlDeviceGetMinorNumber", h)["minor_number"]

    # ------------------------------------------------------------ readings

    def nvmlDeviceGetUtilizationRates(self, h: Handle) -> SimpleNamespace:
        return SimpleNamespace(**self._gpu("nvmlDeviceGetUtilizationRates", h)["utilization"].values_dict())

    def nvmlDeviceGetMemoryInfo(self, h: Handle) -> SimpleNamespace:
        return SimpleNamespace(**self._gpu("nvmlDeviceGetMemoryInfo", h)["memory_bytes"].values_dict())

    def nvmlDeviceGetTemperature(self, h: Handle, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu("nvmlDeviceGetTemperature", h)["temperature_gpu"]

    def nvmlDeviceGetPowerUsage(self, h: Handle) -> int:
        return self._gpu("nvmlDeviceGetPowerUsage", h)["power_mw"]

    def nvmlDeviceGetTotalEnergyConsumption(self, h: Handle) -> int:
        return self._gpu("nvmlDeviceGetTotalEnergyConsumption", h)["energy_mj"]

    def nvmlDeviceGetClockInfo(self, h: Handle, clock: int) -> int:
        clocks = self._gpu("nvmlDeviceGetClockInfo", h)["clocks_mhz"]
        return {pynvml.NVML_CLOCK_SM: clocks["sm"], pynvml.NVML_CLOCK_MEM: clocks["mem"]}[clock]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Handle) -> int:
        return self._gpu("nvmlDeviceGetCurrentClocksEventReasons", h)["clocks_event_reasons"]

    def nvmlDeviceGetPcieReplayCounter(self, h: Handle) -> int:
        return self._gpu("nvmlDeviceGetPcieReplayCounter", h)["pcie_replay"]

    def nvmlDeviceGetTotalEccErrors(self, h: Handle, error_type: int, counter: int) -> int:
        assert counter == pynvml.NVML_VOLATILE_ECC
        ecc = self._gpu("nvmlDeviceGetTotalEccErrors", h)["ecc_volatile"]
        return ecc["corrected" if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else "uncorrected"]

    def nvmlDeviceGetRemappedRows(self, h: Handle) -> tuple[int, int, int, int]:
        rows = self._gpu("nvmlDeviceGetRemappedRows", h)["remapped_rows"]
        return rows["correctable"], rows["uncorrectable"], rows["pending"], rows["failure"]

    def nvmlDeviceGetViolationStatus(self, h: Handle, policy: int) -> SimpleNamespace:
        ns = self._gpu("nvmlDeviceGetViolationStatus", h)["violation_ns"]
        return SimpleNamespace(violationTime=ns["thermal" if policy == pynvml.NVML_PERF_POLICY_THERMAL else "power"])

    def nvmlDeviceGetFieldValues(self, h: Handle, field_ids: list[int]) -> list[SimpleNamespace]:
        recorded = self._gpu("nvmlDeviceGetFieldValues", h)["field_values"]
        by_id = {getattr(pynvml, name): recorded[name] for name in recorded}
        out = []
        for field_id in field_ids:
            spec = by_id.get(field_id)
            if spec is None:  # what the driver does for a field it does not know
                out.append(SimpleNamespace(nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED, valueType=0,
                                           value=SimpleNamespace()))
                continue
            value = SimpleNamespace(**{_VALUE_MEMBERS[spec["type"]]: spec["value"]})
            out.append(SimpleNamespace(nvmlReturn=pynvml.NVML_SUCCESS, valueType=spec["type"], value=value))
        return out

    # ------------------------------------------------------------ events

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: Handle, event_types: int, event_set: str) -> None:
        self._gpu("nvmlDeviceRegisterEvents", h)
        self._registered.add(h.index)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        if not self._events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        gpu, xid = self._events.popleft()
        assert gpu in self._registered, f"GPU {gpu} was never registered for events"
        return SimpleNamespace(device=Handle(gpu), eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid)

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass
