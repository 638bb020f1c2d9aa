"""GPU health from a site's own dcgm-exporter, for nodes where it already runs (most): the sidecar reads its
/metrics instead of NVML and feeds the same heartbeat entries (and so the healer's gpu_fault detector).

    megaheal sidecar --node NAME ... --dcgm-url http://127.0.0.1:9400/metrics

A thread scrapes the endpoint every interval (a timeout on the whole read and a size bound), parses it with
prometheus_client's text parser and keeps the latest per-GPU readings: every DCGM_FI_* field dcgm-exporter serves,
DCGM_FI_PROF_* (tensor, DRAM and engine activity, which NVML alone cannot read) included. /metrics and the heartbeat
only read what the thread kept, so a slow or dead dcgm-exporter holds up neither. A failed scrape is counted,
logged when the endpoint goes from answering to failing, and leaves the GPU readings absent until the next one
answers: the heartbeat then says "absent", as without a driver, and no GPU is judged on stale numbers.

Xid: dcgm-exporter exports only the last Xid (a gauge, DCGM_FI_DEV_XID_ERRORS). A change of that value between
two scrapes counts one Xid of the new code, and so does a non-zero value at the first scrape.
NOTE: dcgm-exporter carries no time with the value, so an Xid from before the sidecar started counts once: for the
critical codes that is the safe side (the GPU still needs its reset), and two Xids of the same code in a row are
one, as on any dashboard reading that gauge. A site wanting every event counted enables
DCGM_EXP_XID_ERRORS_COUNT in dcgm-exporter; megaheal does not read it yet.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.client import HTTPException
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from exporters.nvml_collector import GPU_LABELS, HEALTH_FIELDS
from exporters.xid import XidExposition, XidLedger
from wire.telemetry import GpuEntry

log = logging.getLogger(__name__)

XID_FIELD = "DCGM_FI_DEV_XID_ERRORS"
PROF_PREFIX = "DCGM_FI_PROF_"
# Labels dcgm-exporter adds to single samples rather than to a GPU: the Xid gauge's code and text.
SAMPLE_LABELS = frozenset({"err_code", "err_msg"})
MIB = 2**20
# DCGM's "no value" sentinels (blank, not found, not supported, not permissioned) of its int32, int64 and double
# fields. NOTE: dcgm-exporter leaves such samples out since 3.x, older releases served them as numbers (its own
# README shows DCGM_FI_DEV_MEMORY_TEMP 9223372036854775794): read as values they would be huge ECC counts.
# Exact ints: the parser gives an int for an integer sample, and a float near 2**63 rounds to 2**63.
_BLANKS = ((0x7FFFFFF0, 0x7FFFFFF3), (0x7FFFFFFFFFFFFFF0, 2**63), (2**47, 2**47 + 3))


class ScrapeError(Exception):
    """The endpoint did not answer with a dcgm-exporter exposition; the message says why."""


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU in one scrape: its labels as dcgm-exporter wrote them, and the value of every field by name."""

    gpu: int
    labels: dict[str, str]
    values: dict[str, float] = field(default_factory=dict)

    @property
    def prof(self) -> dict[str, float]:
        """The DCGM_FI_PROF_* readings (profiling: tensor pipe, DRAM, graphics engine activity, PCIe rates)."""
        return {name: value for name, value in self.values.items() if name.startswith(PROF_PREFIX)}


@dataclass(frozen=True, slots=True)
class Scrape:
    gpus: dict[int, GpuReading]
    families: list[Metric]
    """The per-GPU families as served, for republishing."""


def fetch(url: str, timeout_s: float, max_bytes: int) -> str:
    """The body at `url`, read within timeout_s in all and refused past max_bytes."""
    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        while chunk := response.read1(64 * 1024):  # NOTE: read1: one recv each, so the deadline is checked
            size += len(chunk)
            if size > max_bytes:
                raise ScrapeError(f"{url} served more than {max_bytes} bytes")
            if time.monotonic() > deadline:
                raise ScrapeError(f"{url} took more than {timeout_s:g} s to serve its metrics")
            chunks.append(chunk)
    try:
        return b"".join(chunks).decode()
    except UnicodeDecodeError as exc:
        raise ScrapeError(f"{url} served no UTF-8 text: {exc}") from exc


def _blank(value: float) -> bool:
    # NOTE: NaN and the infinities too: the heartbeat carries finite numbers only, and the healer refuses a whole
    # batch that has another (the node would look lost).
    return not math.isfinite(value) or any(low <= value <= high for low, high in _BLANKS)


def _gpu_index(labels: dict[str, str]) -> int | None:
    """The GPU a sample is of; None for samples megaheal does not read per GPU (MIG instances, NVLinks, switches,
    CPUs). NOTE: a MIG instance's samples carry its GPU's index too; the GPU's own health fields are read from the
    samples without GPU_I_ID."""
    value = labels.get("gpu")
    if value is None or "GPU_I_ID" in labels or "nvlink" in labels or not value.isdigit():
        return None
    return int(value)


def parse(text: str) -> Scrape:
    """The per-GPU readings of a dcgm-exporter exposition. Raises ScrapeError for text that is not one."""
    labels: dict[int, set[tuple[str, str]]] = {}
    values: dict[int, dict[str, float]] = {}
    families = []
    try:
        parsed = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ScrapeError(f"not a Prometheus text exposition: {exc}") from exc
    for family in parsed:
        if not family.name.startswith("DCGM_FI_"):
            continue
        kept = Metric(family.name, family.documentation, "gauge" if family.type == "gauge" else "unknown")
        for sample in family.samples:
            gpu = _gpu_index(sample.labels)
            if gpu is None or _blank(sample.value):
                continue
            # NOTE: the parser names a counter's sample <name>_total; dcgm-exporter's names have no such suffix.
            values.setdefault(gpu, {})[family.name] = sample.value
            own = {(k, v) for k, v in sample.labels.items() if k not in SAMPLE_LABELS}
            labels[gpu] = labels[gpu] & own if gpu in labels else own
            kept.add_sample(family.name, sample.labels, sample.value)
        if kept.samples:
            families.append(kept)
    if not values:
        raise ScrapeError("no DCGM_FI_* sample of any GPU")
    return Scrape(gpus={gpu: GpuReading(gpu, _ordered(dict(labels[gpu])), values[gpu]) for gpu in sorted(values)},
                  families=families)


def _ordered(labels: dict[str, str]) -> dict[str, str]:
    """dcgm-exporter's order: its GPU labels first, then the rest (Kubernetes pod labels, ...) by name."""
    first = [k for k in GPU_LABELS if k in labels]
    return {k: labels[k] for k in [*first, *sorted(set(labels) - set(first))]}


class DcgmScrape(Collector):
    """Scrapes a dcgm-exporter on a thread; serves the per-GPU health (`health()`) and megaheal's Xid counter."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        url: str
        """dcgm-exporter's /metrics, e.g. http://127.0.0.1:9400/metrics (its default listener is :9400)."""
        interval_s: float = 5.0
        """Seconds between two scrapes. dcgm-exporter samples every 30 s by default (its -c flag): faster only
        re-reads the same values."""
        timeout_s: float = 3.0
        """A scrape that has not been read in full within this many seconds fails."""
        max_bytes: int = 16 * MIB
        """A larger body fails the scrape (8 GPUs with the default counters serve about 40 KiB)."""
        republish: bool = False
        """Also serve the scraped DCGM_FI_* GPU series on the sidecar's /metrics. Off: a site's Prometheus that
        scrapes dcgm-exporter itself would hold every series twice (and sum() would double)."""

        def __post_init__(self) -> None:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"url must be an http(s) URL of dcgm-exporter's /metrics, got {self.url!r}")
            if self.interval_s <= 0:
                raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
            if self.timeout_s <= 0:
                raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
            if self.max_bytes < 1024:
                raise ValueError(f"max_bytes must be >= 1024, got {self.max_bytes}")

    def __init__(self, cfg: Config, node: str, registry: CollectorRegistry | None = None) -> None:
        self.cfg, self._node = cfg, node
        self.xid = XidLedger()
        self._xid_exposition = XidExposition()
        self._last_xid: dict[int, int] = {}
        self._scrape: Scrape | None = None
        self.scrapes = 0
        self.failures = 0
        """Scrapes that failed (no answer, too slow, too large, not an exposition), since the start."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaheal-dcgm-scrape", daemon=True)
        if registry is not None:
            registry.register(self)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.cfg.timeout_s + 2)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.scrape_once()
            except Exception as exc:  # NOTE: a health probe fails closed: readings absent, the thread goes on
                log.warning("dcgm-exporter at %s: scrape crashed", self.cfg.url, exc_info=True)
                self._failed(exc)
            self._stop.wait(self.cfg.interval_s)

    def scrape_once(self) -> bool:
        """Scrape and keep the readings (True), or count the failure and drop them (False). Never raises for
        what the endpoint does."""
        try:
            scrape = parse(fetch(self.cfg.url, self.cfg.timeout_s, self.cfg.max_bytes))
        except (OSError, HTTPException, ScrapeError) as exc:  # urllib's URLError and HTTPError are OSErrors
            self._failed(exc)
            return False
        self._count_xids(scrape)
        with self._lock:
            if self._scrape is None and self.scrapes:
                log.info("dcgm-exporter at %s answers again: %d GPU(s)", self.cfg.url, len(scrape.gpus))
            self._scrape = scrape
            self.scrapes += 1
        return True

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            was_up, self._scrape = self._scrape is not None or self.scrapes == 0, None
            self.scrapes += 1
            self.failures += 1
        if was_up:
            log.warning("dcgm-exporter at %s: scrape failed (%s); GPU readings absent until it answers",
                        self.cfg.url, exc)

    def _count_xids(self, scrape: Scrape) -> None:
        for gpu, reading in scrape.gpus.items():
            if XID_FIELD not in reading.values:
                continue
            self.xid.watch(gpu)
            value = int(reading.values[XID_FIELD])
            if value != self._last_xid.get(gpu, 0) and value > 0:
                self.xid.record(gpu, value, source="dcgm-exporter")
            self._last_xid[gpu] = value

    # ------------------------------------------------------------ readings

    @property
    def up(self) -> bool:
        """Whether the latest scrape answered (and so GPU readings are there)."""
        with self._lock:
            return self._scrape is not None

    def readings(self) -> dict[int, GpuReading]:
        """The latest scrape's GPUs by index (PROF readings in each one's `prof`); empty while it fails."""
        with self._lock:
            return dict(self._scrape.gpus) if self._scrape is not None else {}

    def health(self) -> list[GpuEntry]:
        """Per GPU, the fields the healer acts on, as NvmlCollector.health() gives them; fields dcgm-exporter is
        not configured to serve are None (its default counters leave out the volatile ECC totals)."""
        xid = self.xid.state()
        out = []
        for index, reading in self.readings().items():
            entry: dict[str, Any] = {"gpu": index, "uuid": reading.labels.get("UUID", reading.labels.get("uuid"))}
            if index in xid:  # as NVML's: the last Xid (0: none yet) of a GPU whose Xids are read
                entry["last_xid"], entry["xid_counts"] = xid[index][0], {str(k): v for k, v in xid[index][1].items()}
            for key, name in HEALTH_FIELDS.items():
                if name in reading.values:
                    entry[key] = reading.values[name]
            out.append(GpuEntry(**entry))
        return out

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            scrape, failures = self._scrape, self.failures
        up = GaugeMetricFamily("megaheal_sidecar_dcgm_up", "1 when the latest scrape of dcgm-exporter answered "
                               "(GPU readings present), 0 when it failed.", labels=["node"])
        up.add_metric([self._node], 1 if scrape is not None else 0)
        yield up
        failed = CounterMetricFamily("megaheal_sidecar_dcgm_scrape_failures", "Scrapes of dcgm-exporter that "
                                     "failed: no answer, too slow, too large, or not an exposition.", labels=["node"])
        failed.add_metric([self._node], failures)
        yield failed
        if scrape is None:
            return
        if self.cfg.republish:
            yield from scrape.families
        # NOTE: the counter carries the labels dcgm-exporter gave the GPU, so it joins with the site's own series.
        yield from self._xid_exposition.family(self.xid.state(), {g: r.labels for g, r in scrape.gpus.items()})
