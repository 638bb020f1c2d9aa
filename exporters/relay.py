"""`megaheal relay`: one node group's heartbeat batches, passed on to the healer as one request per interval.

At 16,384 nodes, one request per node per second is more than one healer process can take: its HTTP stack
alone costs more than a core at that rate (bench/healer_ingest.py). A relay per group of nodes (a rack, a
scalable unit) takes its nodes' batches on the same path and with the same token as the healer
(POST /v1/heartbeats), checks each as the healer would (a bad one is refused to its sender, with the field
named), keeps each node's latest, and every interval posts all of them in one batch to the healer's
/v1/heartbeats/relayed, each with how long ago it came (by the relay's clock: the healer needs no clock
agreement). The batch carries the group's rank entries by column (wire/relay.py's RelayColumns): the
relay decodes each node's batch anyway, and the healer takes columns ~9x cheaper than one JSON object per rank.
Nothing else changes: orders still go from the healer to each node agent directly.

Under a run's mutual TLS (`tls`: the relay's files from the run's authority, ground/tls.py) a node's batch is taken
only with that node's host certificate (one for another node is refused, as the healer refuses it), and the relay
posts to the healer with its own certificate, which the healer requires for relayed batches.

What may be lost: nothing a batch carries, since every batch holds its node's whole current state (the rank
entries, the attempt report with its exits). A relay that is down costs its nodes two intervals: their
forwarders then post to the healer directly (exporters/heartbeat.py) until it answers again.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from exporters.heartbeat import urllib_post
from ground.names import check_name
from ground.secretfile import bearer_matches
from ground.tls import PeerTls, https
from wire.relay import MAX_NODES_PER_RELAY, NodeColumns, columns_of, encode_relay
from wire.telemetry import SchemaError, decode_batch

log = logging.getLogger(__name__)

RELAYED_PATH = "/v1/heartbeats/relayed"


class WrongNode(ValueError):
    """A node's batch sent with another host's certificate."""


@dataclass(frozen=True, slots=True)
class _Held:
    node: NodeColumns
    received: float
    """time.monotonic() when it came."""


class HeartbeatRelay:
    """The latest batch of each node of the group, and the thread that passes them on every interval."""

    def __init__(self, name: str, healer_url: str, token: str, interval_s: float = 1.0, forget_after_s: float = 300.0,
                 max_nodes: int = MAX_NODES_PER_RELAY,
                 post: Callable[[str, bytes, dict[str, str], float], int] = urllib_post,
                 registry: CollectorRegistry | None = None, tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the relay's client context (ground/tls.py): posts then go to a peer whose certificate names the
        run's healer, and the relay shows its own."""
        check_name(name, "relay name")
        if not 0 < interval_s <= 60:
            raise ValueError(f"interval_s must be in (0, 60], got {interval_s}")
        if forget_after_s <= interval_s:
            raise ValueError(f"forget_after_s must be > interval_s, got {forget_after_s}")
        if not 1 <= max_nodes <= MAX_NODES_PER_RELAY:
            raise ValueError(f"max_nodes must be in [1, {MAX_NODES_PER_RELAY}], got {max_nodes}")
        if len(token) < 16:
            raise ValueError("token must be at least 16 characters")
        self.name, self.token = name, token
        self.url = healer_url.rstrip("/") + RELAYED_PATH
        self.interval_s, self.forget_after_s, self.max_nodes = interval_s, forget_after_s, max_nodes
        self._post, self.tls = post, tls
        self._headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaheal-relay", daemon=True)
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.batches_in = Counter("megaheal_relay_batches_received", "Node batches taken.", registry=r)
        self.refused = Counter("megaheal_relay_batches_refused", "Node batches refused, by why.", ["why"], registry=r)
        self.forwarded = Counter("megaheal_relay_forwards", "Relay batches the healer took.", registry=r)
        self.forward_failures = Counter("megaheal_relay_forward_failures", "Relay batches the healer did not take.",
                                        registry=r)
        self.forward_seconds = Histogram("megaheal_relay_forward_seconds", "Time to post one relay batch.",
                                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)
        Gauge("megaheal_relay_nodes", "Nodes whose latest batch the relay holds.", registry=r).set_function(
            lambda: self.nodes)

    @property
    def nodes(self) -> int:
        """Nodes whose latest batch is held."""
        return len(self._held)

    # ---- in -------------------------------------------------------------------------------------------------

    def take(self, body: bytes, sender: str | None = None) -> int:
        """Check one node's batch and keep it as the node's latest; returns its rank entries. Raises SchemaError
        (the field named) for a batch the healer would refuse, OverflowError past max_nodes nodes, and WrongNode
        when `sender` (the host whose certificate it came with) is not the batch's node."""
        try:
            batch = decode_batch(body)
            node = NodeColumns(batch)  # NOTE: now, so that a value no column holds is refused to this node alone
        except SchemaError:
            self.refused.labels("schema").inc()
            raise
        if sender is not None and batch.node != sender:
            self.refused.labels("sender").inc()
            raise WrongNode(f"a batch for node {batch.node!r} came with the certificate of host {sender!r}")
        with self._lock:
            if batch.node not in self._held and len(self._held) >= self.max_nodes:
                self.refused.labels("full").inc()
                raise OverflowError(f"relay {self.name} already holds {self.max_nodes} nodes (max_nodes)")
            self._held[batch.node] = _Held(node, time.monotonic())
        self.batches_in.inc()
        return len(batch.ranks)

    # ---- out ------------------------------------------------------------------------------------------------

    def build(self) -> bytes | None:
        """The batch (RelayColumns) of every node heard of within forget_after_s (None: none)."""
        now = time.monotonic()
        with self._lock:
            for node in [n for n, h in self._held.items() if now - h.received > self.forget_after_s]:
                del self._held[node]  # NOTE: the healer keeps its last batch and sees it age: silence is not lost
            held = list(self._held.values())
        if not held:
            return None
        self._seq += 1
        return encode_relay(columns_of(self.name, self._seq, time.time(),
                                       [(round(max(0.0, now - h.received), 4), h.node) for h in held]))

    def forward(self) -> bool:
        """Post the group's batch now; False when the healer did not take it (the next interval sends the then
        latest: nothing queues up behind a healer that is down)."""
        body = self.build()
        if body is None:
            return True
        started = time.perf_counter()
        timeout_s = min(5.0, 2 * self.interval_s)
        try:
            if self.tls is not None:
                status = https("POST", self.url, body, self._headers, timeout_s, PeerTls(self.tls, "healer"), 4096)[0]
            else:
                status = self._post(self.url, body, self._headers, timeout_s)
        except (OSError, TimeoutError) as exc:
            return self._failed(f"cannot reach the healer at {self.url}: {exc}")
        finally:
            self.forward_seconds.observe(time.perf_counter() - started)
        if 200 <= status < 300:
            self.forwarded.inc()
            self.failures = 0
            return True
        return self._failed(f"the healer at {self.url} answered HTTP {status}")

    def _failed(self, message: str) -> bool:
        self.forward_failures.inc()
        self.failures += 1
        # NOTE: one line per streak of failures, not one per interval while the healer is down.
        if self.failures == 1 or self.failures % 300 == 0:
            log.warning("%s (failures so far: %d)", message, self.failures)
        return False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        # NOTE: at a fixed cadence from the start, not interval after each post: a slow post must not stretch it.
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += self.interval_s
            try:
                self.forward()
            except Exception:  # noqa: BLE001 - one bad interval is logged, never the thread's end
                log.error("building or posting a relay batch failed", exc_info=True)
            self._stop.wait(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at, time.monotonic() - self.interval_s)

    def authorized(self, header: str) -> bool:
        return bearer_matches(header, self.token)
