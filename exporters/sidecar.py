"""The node sidecar: receives rank records, serves /metrics, forwards heartbeats and traces.

    megaheal sidecar --node NAME [--socket PATH] [--metrics-addr 127.0.0.1:9400] [--healer-url URL]
                     [--healer-token-file FILE] [--otlp-endpoint URL]

One per node, beside torchrun; ranks find it through MEGAHEAL_SIDECAR_SOCKET. Each part runs on
its own thread (receiver, HTTP server, heartbeat, Xid watcher, span batching) so that none can hold
up another, and none of them can hold up training: ranks only ever write to a datagram socket.
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

from exporters.heartbeat import HeartbeatForwarder, rank_summary
from exporters.nvml_collector import NvmlCollector, open_nvml
from exporters.rank_collector import RankCollector, SidecarCollector
from exporters.ranks import RankTable
from exporters.receiver import DatagramReceiver
from exporters.traces import StepTracer, otlp_exporter
from exporters.xid import XidWatcher
from ground.names import check_name
from ground.secretfile import check_token, read_secret
from wire.telemetry import HEARTBEAT_SCHEMA, HeartbeatBatch, Message, StepRecord, known_phases_only

log = logging.getLogger(__name__)

AUTO = "auto"
TOKEN_ENV = "MEGAHEAL_TOKEN"


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
        metrics_addr: str = "127.0.0.1:9400"
        """HOST:PORT of /metrics; loopback unless told otherwise. Port 0 picks a free one."""
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
        """`nvml`: AUTO opens the real NVML (absent: logged once), None disables it, or a handle to use."""
        self.cfg = cfg
        self.registry = registry if registry is not None else CollectorRegistry()
        self.table = RankTable(forget_after_s=cfg.forget_after_s, max_ranks=cfg.max_ranks)
        RankCollector(self.table, cfg.node, registry=self.registry)
        SidecarCollector(self._stats, cfg.node, registry=self.registry)
        ProcessCollector(registry=self.registry)
        self.nvml_collector, self.xid = self._start_nvml(open_nvml() if nvml == AUTO else nvml)
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
        try:
            collector.xid = XidWatcher(nvml, collector.handles)
        except nvml.NVMLError:
            log.warning("NVML: no event sets on this driver; Xid metrics are off", exc_info=True)
        self.registry.register(collector)
        return collector, collector.xid

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
        if self.heartbeat is not None:
            self.heartbeat.start()
        log.info("megaheal sidecar on node %s: ranks -> %s; metrics %s; healer %s; traces %s; GPUs %s",
                 self.cfg.node, self.cfg.socket_path, self.metrics_url, self.cfg.healer_url or "off",
                 self.cfg.otlp_endpoint or ("in-process" if self.tracer else "off"),
                 len(self.nvml_collector.handles) if self.nvml_collector else "none")

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
        return HeartbeatBatch(
            schema=HEARTBEAT_SCHEMA, node=self.cfg.node, seq=seq, sent_at=sent_at,
            nvml="ok" if self.nvml_collector is not None else "absent",
            ranks=[rank_summary(s) for s in self.table.heartbeat_snapshot()],
            gpus=self.nvml_collector.health() if self.nvml_collector is not None else [],
        )

    def _stats(self) -> dict[str, float]:
        hb = self.heartbeat
        return {
            "received": self.receiver.received, "malformed": self.receiver.malformed,
            "rejected_senders": self.receiver.rejected_senders, "rejected_phases": self.rejected_phases,
            "rejected_ranks": self.table.rejected, "forgotten_ranks": self.table.forgotten, "ranks": len(self.table),
            "heartbeats_sent": hb.sent if hb else 0, "heartbeat_failures": hb.failures if hb else 0,
            "heartbeats_dropped": hb.dropped if hb else 0, "heartbeats_buffered": hb.buffered if hb else 0,
            "nvml_up": 1 if self.nvml_collector is not None else 0,
            "trace_batches_failed": getattr(self.span_exporter, "failed_batches", 0),
        }
