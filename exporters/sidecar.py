"""The node sidecar: receives rank records, serves /metrics, forwards heartbeats and traces.

    megaheal sidecar --node NAME [--socket PATH] [--metrics-addr 127.0.0.1:9471] [--healer-url URL]
                     [--token-file FILE] [--otlp-endpoint URL] [--dcgm-url URL]

One per node, beside torchrun; ranks find it through MEGAHEAL_SIDECAR_SOCKET. Each part runs on its own thread
(receiver, HTTP server, heartbeat, Xid watcher or dcgm-exporter scrape, span batching) so that none can hold up
another, and none of them can hold up training: ranks only ever write to a datagram socket.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

from exporters.dcgm_scrape import DcgmScrape
from exporters.heartbeat import HeartbeatForwarder, rank_summary
from exporters.nvml_collector import NvmlCollector, open_nvml
from exporters.rank_collector import RankCollector, SidecarCollector
from exporters.ranks import RankTable
from exporters.receiver import DatagramReceiver
from exporters.traces import StepTracer, otlp_exporter
from exporters.xid import XidWatcher
from ground.names import check_name
from ground.secretfile import check_token, read_secret
from wire.telemetry import HEARTBEAT_SCHEMA, GpuEntry, HeartbeatBatch, Message, StepRecord, known_phases_only

log = logging.getLogger(__name__)

AUTO = "auto"
TOKEN_ENV = "MEGAHEAL_TOKEN"
METRICS_PORT = 9471
"""NOTE: not 9400, dcgm-exporter's default: most GPU sites run it on every node, and a sidecar on its port fails to
start there (or, started first, keeps dcgm-exporter out). Not 9100 (node_exporter) either; 9472 is `megaheal run`'s
goodput metrics and 9410 the relay's listener, so the sidecar takes the port beside them."""


def default_socket_path() -> str:
    """A per-user path under the temp directory, so two users' sidecars on one machine do not collide."""
    return str(Path(tempfile.gettempdir()) / f"megaheal-{os.getuid()}" / "sidecar.sock")


def _http_url(value: str | None, name: str) -> None:
    if value is not None and (urlsplit(value).scheme not in ("http", "https") or not urlsplit(value).netloc):
        raise ValueError(f"{name} must be an http(s) URL, got {value!r}")


class Sidecar:
    @dataclass(kw_only=True, slots=True)
    class Config:
        node: str
        """Name of this node in every series and heartbeat (what operators call the machine)."""
        socket_path: str
        """AF_UNIX datagram socket the ranks send to (their MEGAHEAL_SIDECAR_SOCKET)."""
        metrics_addr: str = f"127.0.0.1:{METRICS_PORT}"
        """HOST:PORT of /metrics; loopback unless told otherwise. Port 0 picks a free one."""
        dcgm: DcgmScrape.Config | None = None
        """Read the GPUs from this node's dcgm-exporter (its /metrics) instead of NVML: for sites that run it
        already, and for the DCGM_FI_PROF_* readings NVML lacks. Unset: NVML."""
        healer_url: str | None = None
        """Base URL of the healer; heartbeat batches go to its /v1/heartbeats. Unset: no heartbeats."""
        relay_url: str | None = None
        """Base URL of this node group's relay (`megaheal relay`): batches go there, and to the healer itself while
        it does not answer. For jobs of thousands of nodes, where one request per node per second is too many."""
        healer_token_file: str | None = None
        """File holding the healer's bearer token (ground.secretfile's rules). Unset: MEGAHEAL_TOKEN, which
        every same-uid process (the ranks) can read in /proc/PID/environ: prefer the file."""
        otlp_endpoint: str | None = None
        """OTLP/HTTP collector URL for step traces. Unset: no traces."""
        heartbeat_interval_s: float = 1.0
        """Seconds between two heartbeat batches."""
        heartbeat_buffer: int = 60
        """Heartbeat batches kept for retry while the healer is unreachable (the oldest are dropped)."""
        forget_after_s: float = 600.0
        """A rank silent this long leaves the metrics and heartbeats, whether its process lives or not."""
        max_ranks: int = 256
        """Ranks tracked at most (bounds the series a misbehaving sender can create)."""

        def __post_init__(self) -> None:
            # NOTE: the healer refuses a whole batch whose node is not a name: refuse such a sidecar at start instead.
            check_name(self.node, "node")
            if not self.socket_path:
                raise ValueError("socket_path must be set")
            host, _, port = self.metrics_addr.rpartition(":")
            if not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"metrics_addr must be HOST:PORT, got {self.metrics_addr!r}")
            _http_url(self.healer_url, "healer_url")
            _http_url(self.relay_url, "relay_url")
            if self.relay_url and not self.healer_url:
                raise ValueError("relay_url needs healer_url (where the batches go while the relay is down)")
            _http_url(self.otlp_endpoint, "otlp_endpoint")
            if self.heartbeat_interval_s <= 0:
                raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
            if self.heartbeat_buffer < 1:
                raise ValueError(f"heartbeat_buffer must be >= 1, got {self.heartbeat_buffer}")
            if self.forget_after_s <= 0:
                raise ValueError(f"forget_after_s must be > 0, got {self.forget_after_s}")
            if self.max_ranks < 1:
                raise ValueError(f"max_ranks must be >= 1, got {self.max_ranks}")

    def __init__(self, cfg: Config, nvml: Any = AUTO, span_exporter: SpanExporter | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        """`nvml`: AUTO opens the real NVML (absent: logged once), None disables it, or a handle to use; not
        used when cfg.dcgm names a dcgm-exporter to read instead."""
        self.cfg = cfg
        self.registry = registry if registry is not None else CollectorRegistry()
        self.table = RankTable(forget_after_s=cfg.forget_after_s, max_ranks=cfg.max_ranks)
        RankCollector(self.table, cfg.node, registry=self.registry)
        SidecarCollector(self._stats, cfg.node, registry=self.registry)
        ProcessCollector(registry=self.registry)
        self.dcgm = DcgmScrape(cfg.dcgm, cfg.node, registry=self.registry) if cfg.dcgm is not None else None
        # NOTE: with dcgm-exporter as the source NVML is never opened: the two would report the same GPUs twice.
        self.nvml_collector, self.xid = (None, None) if self.dcgm is not None else self._start_nvml(
            open_nvml() if nvml == AUTO else nvml)
        if span_exporter is None and cfg.otlp_endpoint:
            span_exporter = otlp_exporter(cfg.otlp_endpoint)
        self.span_exporter = span_exporter
        self.tracer = StepTracer(cfg.node, span_exporter) if span_exporter is not None else None
        self.heartbeat = (
            HeartbeatForwarder(cfg.healer_url, self.heartbeat_batch, cfg.heartbeat_interval_s, cfg.heartbeat_buffer,
                               token=self._token(), relay_url=cfg.relay_url)
            if cfg.healer_url else None
        )
        self.receiver = DatagramReceiver(Path(cfg.socket_path), self._on_message)
        self.rejected_phases = 0
        """Phase names left out of step records because the trainer has no such phase (see known_phases_only)."""
        self._httpd: Any = None
        self._stopped = threading.Event()

    def _token(self) -> str | None:
        if self.cfg.healer_token_file:
            return check_token(read_secret(self.cfg.healer_token_file, "healer token"), self.cfg.healer_token_file)
        return os.environ.get(TOKEN_ENV)

    def _start_nvml(self, nvml: Any) -> tuple[NvmlCollector | None, XidWatcher | None]:
        if nvml is None:
            return None, None
        try:
            collector = NvmlCollector(nvml, self.cfg.node)
        except nvml.NVMLError:
            # NOTE: fail closed: a driver that answers nvmlInit but not device queries must not stop the sidecar.
            log.warning("NVML: cannot enumerate the GPUs; GPU metrics are off", exc_info=True)
            return None, None
        watcher = None
        try:
            watcher = collector.xid = XidWatcher(nvml, collector.handles)
        except nvml.NVMLError:
            log.warning("NVML: no event sets on this driver; Xid metrics are off", exc_info=True)
        self.registry.register(collector)
        return collector, watcher

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        host, _, port = self.cfg.metrics_addr.rpartition(":")
        try:
            self._httpd, _ = start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
        except OSError:
            self.receiver.stop()  # do not leave our socket behind for the next sidecar to probe
            raise
        self.receiver.start()
        if self.xid is not None:
            self.xid.start()
        if self.dcgm is not None:
            self.dcgm.start()
        if self.heartbeat is not None:
            self.heartbeat.start()
        log.info("megaheal sidecar on node %s: ranks -> %s; metrics %s; healer %s; traces %s; GPUs %s",
                 self.cfg.node, self.cfg.socket_path, self.metrics_url, self.cfg.healer_url or "off",
                 self.cfg.otlp_endpoint or ("in-process" if self.tracer else "off"),
                 f"from dcgm-exporter at {self.dcgm.cfg.url}" if self.dcgm is not None
                 else len(self.nvml_collector.handles) if self.nvml_collector else "none")

    @property
    def metrics_url(self) -> str:
        host = self.cfg.metrics_addr.rpartition(":")[0]
        port = self._httpd.server_port if self._httpd is not None else self.cfg.metrics_addr.rpartition(":")[2]
        return f"http://{host}:{port}/metrics"

    def stop(self) -> None:
        """Stop every thread, remove the socket, flush queued spans. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.receiver.stop()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.xid is not None:
            self.xid.stop()
        if self.dcgm is not None:
            self.dcgm.stop()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self.tracer is not None:
            self.tracer.shutdown()

    def serve_forever(self) -> None:
        """Run until SIGTERM or SIGINT (main thread only)."""
        # NOTE: the kernel queues only ~10 datagrams per socket (net.unix.max_dgram_qlen); a scrape holding
        # the GIL for the default 5 ms switch interval can let a burst from 8 ranks overflow it. A shorter
        # interval hands the GIL to the woken receiver sooner. Process-wide, so only in the sidecar's own process.
        sys.setswitchinterval(0.0005)
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        self.start()
        try:
            done.wait()
        finally:
            self.stop()

    # ------------------------------------------------------------ data

    def _on_message(self, message: Message) -> None:
        message, unknown = known_phases_only(message)
        self.rejected_phases += unknown
        self.table.observe(message)
        if self.tracer is not None and isinstance(message, StepRecord):
            self.tracer.record(message)

    def heartbeat_batch(self, seq: int, sent_at: float) -> HeartbeatBatch:
        nvml, gpus = self._gpu_health()
        return HeartbeatBatch(
            schema=HEARTBEAT_SCHEMA, node=self.cfg.node, seq=seq, sent_at=sent_at, nvml=nvml,
            ranks=[rank_summary(s) for s in self.table.heartbeat_snapshot()], gpus=gpus,
        )

    def _gpus_up(self) -> bool:
        """Whether GPU readings are there: NVML started, or dcgm-exporter's latest scrape answered."""
        return self.dcgm.up if self.dcgm is not None else self.nvml_collector is not None

    def _gpu_health(self) -> tuple[str, list[GpuEntry]]:
        """The heartbeat's GPU source state and entries, read together (a scrape may land between two reads)."""
        if self.dcgm is not None:
            # A failed scrape keeps no readings: "absent", as on a node without a driver, never stale numbers.
            gpus = self.dcgm.health()
            return ("ok" if gpus else "absent"), gpus
        if self.nvml_collector is None:
            return "absent", []
        return "ok", self.nvml_collector.health()

    def _stats(self) -> dict[str, float]:
        hb = self.heartbeat
        return {
            "received": self.receiver.received, "malformed": self.receiver.malformed,
            "rejected_senders": self.receiver.rejected_senders, "rejected_phases": self.rejected_phases,
            "rejected_ranks": self.table.rejected, "forgotten_ranks": self.table.forgotten, "ranks": len(self.table),
            "heartbeats_sent": hb.sent if hb else 0, "heartbeat_failures": hb.failures if hb else 0,
            "heartbeats_dropped": hb.dropped if hb else 0, "heartbeats_buffered": hb.buffered if hb else 0,
            "nvml_up": 1 if self._gpus_up() else 0,
            "trace_batches_failed": getattr(self.span_exporter, "failed_batches", 0),
        }
