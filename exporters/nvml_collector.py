"""GPU metrics from NVML under dcgm-exporter's names and labels, so existing dashboards and rules work.

The NVML handle is passed in (`nvml`: the pynvml module, or a recorded device in tests). Every
family is read afresh at scrape time, GPU by GPU; a read that fails (NotSupported is normal: an
older GPU, a PCIe card without NVLink) leaves out only that GPU's sample of that family, and a
family with no sample is left out, while the rest of the scrape goes on.

dcgm-exporter types some fields as counters whose names do not end in _total; the Prometheus
client (and OpenMetrics) only allow counters named *_total, so those keep their names and are
exposed untyped: PromQL's rate()/increase() work the same on them.

The labels are dcgm-exporter's, names, casing and order (matched against dcgm-exporter 4.5.3-4.8.2, its latest
release: internal/pkg/rendermetrics/render_metrics.go and etc/default-counters.csv): gpu, UUID, pci_bus_id, device,
modelName, Hostname, then DCGM_FI_DRIVER_VERSION (a "label" field of its default counters), so that a site's
dashboards (Grafana 12239) and queries select megaheal's series and dcgm-exporter's alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from exporters.xid import XidExposition, XidLedger
from wire.telemetry import GpuEntry

log = logging.getLogger(__name__)

HOST_LABEL = "Hostname"
"""NOTE: dcgm-exporter's main branch renamed it `hostname` after 4.5.3-4.8.2 (its PR #655, unreleased when this was
written); every release so far says `Hostname`. Follow it here, and in the dashboards, when a release carries it."""
DRIVER_LABEL = "DCGM_FI_DRIVER_VERSION"
GPU_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", HOST_LABEL, DRIVER_LABEL]
"""dcgm-exporter's label set, in its order. Like dcgm-exporter, the driver label is left out where the driver
version cannot be read (NvmlCollector.label_names says which set a collector uses)."""
MIB = 2**20

Reader = Callable[[Any, Any], float]


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    doc: str
    kind: str  # "gauge", or "unknown" for dcgm-exporter's counters without a _total suffix
    read: Reader


def _field(field_id_name: str) -> Reader:
    """Read one NVML field value (nvmlDeviceGetFieldValues), raising NVMLError when the field fails."""
    def read(nvml: Any, handle: Any) -> float:
        value = nvml.nvmlDeviceGetFieldValues(handle, [getattr(nvml, field_id_name)])[0]
        if value.nvmlReturn != nvml.NVML_SUCCESS:
            raise nvml.NVMLError(value.nvmlReturn)
        member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
        return float(getattr(value.value, member[value.valueType]))
    return read


def _clocks_event_reasons(nvml: Any, handle: Any) -> float:
    # NOTE: renamed from "throttle reasons" in driver 535; older bindings only have the old name.
    getter = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    return float((getter or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)(handle))


def _ecc(kind: str) -> Reader:
    return lambda nvml, h: float(nvml.nvmlDeviceGetTotalEccErrors(h, getattr(nvml, kind), nvml.NVML_VOLATILE_ECC))


def _violation_us(policy: str) -> Reader:
    # NVML reports nanoseconds; DCGM (and so its dashboards) use microseconds.
    return lambda nvml, h: nvml.nvmlDeviceGetViolationStatus(h, getattr(nvml, policy)).violationTime / 1000.0


FAMILIES: tuple[Family, ...] = (
    Family("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "gauge",
           lambda n, h: float(n.nvmlDeviceGetUtilizationRates(h).gpu)),
    Family("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "gauge",
           lambda n, h: float(n.nvmlDeviceGetUtilizationRates(h).memory)),
    Family("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "gauge",
           lambda n, h: n.nvmlDeviceGetMemoryInfo(h).used / MIB),
    Family("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "gauge",
           lambda n, h: n.nvmlDeviceGetMemoryInfo(h).free / MIB),
    Family("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "gauge",
           lambda n, h: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))),
    Family("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).", "gauge", _field("NVML_FI_DEV_MEMORY_TEMP")),
    Family("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "gauge",
           lambda n, h: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
    Family("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Total energy consumption since boot (in mJ).", "unknown",
           lambda n, h: float(n.nvmlDeviceGetTotalEnergyConsumption(h))),
    Family("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "gauge",
           lambda n, h: float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))),
    Family("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", "gauge",
           lambda n, h: float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM))),
    Family("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "Current clock event reasons (bitmask of NVML clocks event "
           "reasons: 0x1 idle, 0x4 SW power cap, 0x8 HW slowdown, 0x20 SW thermal, 0x40 HW thermal, 0x80 power "
           "brake).", "gauge", _clocks_event_reasons),
    Family("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries.", "unknown",
           lambda n, h: float(n.nvmlDeviceGetPcieReplayCounter(h))),
    Family("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.", "unknown",
           _ecc("NVML_MEMORY_ERROR_TYPE_CORRECTED")),
    Family("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.", "unknown",
           _ecc("NVML_MEMORY_ERROR_TYPE_UNCORRECTED")),
    Family("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for correctable errors.", "unknown",
           lambda n, h: float(n.nvmlDeviceGetRemappedRows(h)[0])),
    Family("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for uncorrectable errors.",
           "unknown", lambda n, h: float(n.nvmlDeviceGetRemappedRows(h)[1])),
    Family("DCGM_FI_DEV_ROW_REMAP_PENDING", "Whether remapping of rows is pending (a GPU reset applies it).",
           "gauge", lambda n, h: float(n.nvmlDeviceGetRemappedRows(h)[2])),
    Family("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether remapping of rows has failed.", "gauge",
           lambda n, h: float(n.nvmlDeviceGetRemappedRows(h)[3])),
    Family("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "Total number of NVLink flow-control CRC errors.",
           "unknown", _field("NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL")),
    Family("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "Total number of NVLink data CRC errors.", "unknown",
           _field("NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL")),
    Family("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "Total number of NVLink retries.", "unknown",
           _field("NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL")),
    Family("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "Total number of NVLink recovery errors.", "unknown",
           _field("NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL")),
    Family("DCGM_FI_DEV_THERMAL_VIOLATION", "Throttling duration due to thermal constraints (in us).", "unknown",
           _violation_us("NVML_PERF_POLICY_THERMAL")),
    Family("DCGM_FI_DEV_POWER_VIOLATION", "Throttling duration due to power constraints (in us).", "unknown",
           _violation_us("NVML_PERF_POLICY_POWER")),
    Family("DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION", "Recovery action the driver asks for: 0 none, 1 GPU reset, "
           "2 node reboot, 3 drain P2P, 4 drain and reset.", "gauge", _field("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")),
)

# Read for the healer's heartbeat every interval: the fields that say a GPU needs to leave the job.
HEALTH_FIELDS = {
    "ecc_dbe_volatile": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "uncorrectable_remapped_rows": "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "row_remap_pending": "DCGM_FI_DEV_ROW_REMAP_PENDING",
    "row_remap_failure": "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "recovery_action": "DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION",
}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def open_nvml(module: Any = None) -> Any | None:
    """The initialised NVML bindings (pynvml unless `module` is given), or None, said in one line, without a driver."""
    pynvml = module
    if pynvml is None:
        try:
            import pynvml
        except ImportError:
            log.warning("NVML: nvidia-ml-py is not installed; GPU metrics are off, training metrics are served")
            return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.warning("NVML: no NVIDIA driver on this node (%s); GPU metrics are off, training metrics are served", exc)
        return None
    return pynvml


def _driver_version(nvml: Any) -> str | None:
    try:
        return _text(nvml.nvmlSystemGetDriverVersion())
    except nvml.NVMLError as exc:
        log.warning("NVML: the driver version cannot be read (%s); the %s label is left out", exc, DRIVER_LABEL)
        return None


class NvmlCollector(Collector):
    """dcgm-exporter-compatible GPU families, plus per-code Xid counters when an Xid ledger is given."""

    def __init__(self, nvml: Any, hostname: str, xid: XidLedger | None = None,
                 registry: CollectorRegistry | None = None, families: tuple[Family, ...] = FAMILIES) -> None:
        self._nvml, self._families = nvml, families
        # Set after construction when the watcher needs the handles found here (see Sidecar).
        self.xid = xid
        self.handles: list[Any] = []
        self._labels: list[list[str]] = []
        driver = _driver_version(nvml)
        self.label_names = GPU_LABELS if driver is not None else GPU_LABELS[:-1]
        # The GPUs of a node do not change while it runs: read their identities once.
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            self.handles.append(handle)
            # NOTE: device is nvidia<index>, as dcgm-exporter writes it (from DCGM's GPU id), not the minor number.
            self._labels.append([
                str(index), _text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetPciInfo(handle).busId),
                f"nvidia{index}", _text(nvml.nvmlDeviceGetName(handle)), hostname,
                *([driver] if driver is not None else []),
            ])
        self._xid_exposition = XidExposition()
        self._not_supported: set[tuple[str, int]] = set()
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            metric = Metric(family.name, family.doc, family.kind)
            for index, handle in enumerate(self.handles):
                value = self._read(family, index, handle)
                if value is not None:
                    metric.add_sample(family.name, dict(zip(self.label_names, self._labels[index])), value)
            if metric.samples:
                yield metric
        if self.xid is not None:
            yield from self._xid_families()

    def _read(self, family: Family, index: int, handle: Any) -> float | None:
        try:
            return family.read(self._nvml, handle)
        except self._nvml.NVMLError as exc:
            if (family.name, index) not in self._not_supported:
                self._not_supported.add((family.name, index))
                level = logging.DEBUG if exc.value == self._nvml.NVML_ERROR_NOT_SUPPORTED else logging.WARNING
                log.log(level, "NVML: %s of GPU %d unavailable: %s", family.name, index, exc)
            return None

    def _xid_families(self) -> Iterator[Metric]:
        assert self.xid is not None
        state = self.xid.state()
        if not state:
            return
        last = Metric("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", "gauge")
        for gpu, (last_xid, _) in state.items():
            last.add_sample("DCGM_FI_DEV_XID_ERRORS", dict(zip(self.label_names, self._labels[gpu])), last_xid)
        yield last
        yield from self._xid_exposition.family(
            state, {gpu: dict(zip(self.label_names, labels)) for gpu, labels in enumerate(self._labels)})

    def health(self) -> list[GpuEntry]:
        """Per GPU, the fields the healer acts on (Xid, ECC, remapping, recovery action); failed reads are None."""
        by_name = {f.name: f for f in self._families}
        xid = self.xid.state() if self.xid is not None else {}
        out = []
        for index, handle in enumerate(self.handles):
            entry: dict[str, Any] = {"gpu": index, "uuid": self._labels[index][1]}
            if index in xid:
                entry["last_xid"], entry["xid_counts"] = xid[index][0], {str(k): v for k, v in xid[index][1].items()}
            for key, name in HEALTH_FIELDS.items():
                if name in by_name and (value := self._read(by_name[name], index, handle)) is not None:
                    entry[key] = value
            out.append(GpuEntry(**entry))
        return out
