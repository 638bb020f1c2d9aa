"""Xid errors: the last Xid of each GPU and a count per Xid code, from NVML event sets or a dcgm-exporter scrape.

dcgm-exporter's DCGM_FI_DEV_XID_ERRORS is a gauge holding the *last* Xid: `increase()` on it is
meaningless, and two Xid 79 in a row look like one. So megaheal also keeps a counter per code,
exported as megaheal_gpu_xid_errors_total{xid} (XidExposition below).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import Metric

from ground.gpu_faults import CRITICAL_XIDS

log = logging.getLogger(__name__)

XID_COUNTER = "megaheal_gpu_xid_errors"


class XidLedger:
    """The last Xid and the count per code of each watched GPU; written by one source, read by scrapes and
    heartbeats (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.last: dict[int, int] = {}
        self.counts: dict[int, Counter[int]] = {}

    @property
    def watched(self) -> list[int]:
        with self._lock:
            return sorted(self.last)

    def watch(self, gpu: int) -> None:
        with self._lock:
            self.last.setdefault(gpu, 0)
            self.counts.setdefault(gpu, Counter())

    def record(self, gpu: int, xid: int, source: str = "NVML") -> None:
        log.warning("%s: GPU %d reported Xid %d", source, gpu, xid)
        with self._lock:
            self.last[gpu] = xid
            self.counts.setdefault(gpu, Counter())[xid] += 1

    def state(self) -> dict[int, tuple[int, dict[int, int]]]:
        """gpu -> (last Xid or 0, {xid: count}) for every watched GPU."""
        with self._lock:
            return {gpu: (self.last.get(gpu, 0), dict(self.counts.get(gpu, {}))) for gpu in sorted(self.last)}


class XidWatcher(XidLedger):
    """Waits on an NVML event set for critical Xid events of every GPU that supports them."""

    def __init__(self, nvml: Any, handles: list[Any], wait_ms: int = 500) -> None:
        super().__init__()
        self._nvml, self._wait_ms = nvml, wait_ms
        self._event_set = nvml.nvmlEventSetCreate()
        for index, handle in enumerate(handles):
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._event_set)
            except nvml.NVMLError as exc:
                log.warning("NVML: GPU %d does not report Xid events (%s); its Xid metrics are absent", index, exc)
                continue
            self.watch(index)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaheal-xid", daemon=True)

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


class XidExposition:
    """megaheal_gpu_xid_errors_total for a scraper: every series is seen at 0 before it counts anything.

    NOTE: Prometheus' increase()/rate() take a series' first sample as its start, so a counter born at 1 shows no
    increase at all: the first Xid of a code would be invisible to the alert rules. The conventional cure is to
    create the child at 0 before the event: every critical Xid (ground.gpu_faults.CRITICAL_XIDS) of every watched
    GPU is exposed at 0 from the first scrape on; a code outside that set, first seen between two scrapes, is shown
    at 0 in the next scrape and at its count from the one after (one scrape late, but seen). With two Prometheus
    scraping one sidecar, only the first to scrape after the event sees that 0: the critical codes do not depend on it.
    """

    def __init__(self, zero_codes: Sequence[int] = CRITICAL_XIDS) -> None:
        self._zero_codes = tuple(zero_codes)
        self._lock = threading.Lock()
        self._exposed: set[tuple[int, int]] = set()

    def family(self, state: dict[int, tuple[int, dict[int, int]]],
               labels: dict[int, dict[str, str]]) -> Iterator[Metric]:
        """The counter family for `state` (XidLedger.state()), each GPU's series under its `labels` (by index)."""
        counts = Metric(XID_COUNTER, "Xid errors seen since the sidecar started, by code (increase() works on "
                        "this one).", "counter")
        with self._lock:
            for gpu, (_, by_code) in sorted(state.items()):
                if gpu not in labels:
                    continue
                for code in sorted(set(self._zero_codes) | set(by_code)):
                    seen = (gpu, code) in self._exposed or code in self._zero_codes
                    self._exposed.add((gpu, code))
                    counts.add_sample(f"{XID_COUNTER}_total", {**labels[gpu], "xid": str(code)},
                                      by_code.get(code, 0) if seen else 0)
        if counts.samples:
            yield counts
