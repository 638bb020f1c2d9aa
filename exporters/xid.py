"""Xid errors from NVML event sets: the last Xid of each GPU and a count per Xid code.

dcgm-exporter's DCGM_FI_DEV_XID_ERRORS is a gauge holding the *last* Xid: `increase()` on it is
meaningless, and two Xid 79 in a row look like one. So the watcher also keeps a counter per code,
exported as megaheal_gpu_xid_errors_total{xid}.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

log = logging.getLogger(__name__)


class XidWatcher:
    """Waits on an NVML event set for critical Xid events of every GPU that supports them."""

    def __init__(self, nvml: Any, handles: list[Any], wait_ms: int = 500) -> None:
        self._nvml, self._wait_ms = nvml, wait_ms
        self._lock = threading.Lock()
        self.last: dict[int, int] = {}
        self.counts: dict[int, Counter[int]] = {}
        self._event_set = nvml.nvmlEventSetCreate()
        for index, handle in enumerate(handles):
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._event_set)
            except nvml.NVMLError as exc:
                log.warning("NVML: GPU %d does not report Xid events (%s); its Xid metrics are absent", index, exc)
                continue
            self.last[index] = 0
            self.counts[index] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaheal-xid", daemon=True)

    @property
    def watched(self) -> list[int]:
        return sorted(self.last)

    def start(self) -> None:
        if self.last:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._wait_ms / 1000 + 2)
        try:
            self._nvml.nvmlEventSetFree(self._event_set)
        except self._nvml.NVMLError:
            log.debug("NVML: freeing the Xid event set failed", exc_info=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll(self._wait_ms)

    def poll(self, timeout_ms: int) -> int:
        """Wait up to timeout_ms for one event; returns how many Xid events it recorded (0 or 1)."""
        nvml = self._nvml
        try:
            data = nvml.nvmlEventSetWait_v2(self._event_set, timeout_ms)
        except nvml.NVMLError as exc:
            if exc.value != nvml.NVML_ERROR_TIMEOUT:
                # E.g. the GPU fell off the bus: keep watching the others, without spinning.
                log.warning("NVML: waiting for Xid events failed: %s", exc)
                self._stop.wait(timeout_ms / 1000)
            return 0
        if not data.eventType & nvml.nvmlEventTypeXidCriticalError:
            return 0
        try:
            index = nvml.nvmlDeviceGetIndex(data.device)
        except nvml.NVMLError:
            log.warning("NVML: Xid %d on a GPU whose index cannot be read", data.eventData)
            return 0
        self.record(index, int(data.eventData))
        return 1

    def record(self, gpu: int, xid: int) -> None:
        log.warning("NVML: GPU %d reported Xid %d", gpu, xid)
        with self._lock:
            self.last[gpu] = xid
            self.counts.setdefault(gpu, Counter())[xid] += 1

    def state(self) -> dict[int, tuple[int, dict[int, int]]]:
        """gpu -> (last Xid or 0, {xid: count}) for every watched GPU."""
        with self._lock:
            return {gpu: (self.last.get(gpu, 0), dict(self.counts.get(gpu, {}))) for gpu in sorted(self.last)}
