"""Heartbeat batches: once per interval, the node's view of all its ranks (and GPUs), posted to the healer.

Batch (JSON, schema 1), one per node per interval: wire/telemetry.py's HeartbeatBatch,

    {"schema": 1, "node": "n1", "seq": 7, "sent_at": <unix s>, "nvml": "ok" | "absent",
     "ranks": [{"job", "rank", "alive", "last_seen_age_s", "pid", "local_rank", "world_size", "mesh",
                "dropped", "events", "last_event", "step", "step_time", "step_seconds", "phases", "loss",
                "grad_norm", "nonfinite", "tokens_per_second", "mfu", "dp_reduce_enter_ns", "dp_reduce_lag_s",
                "max_rss_mib", "proc_state"}],                      (RankEntry, built by rank_summary)
     "gpus": [{"gpu", "uuid", "last_xid", "xid_counts", ...health fields}]}      (GpuEntry)

Posts run on their own thread with a short timeout; batches that fail wait in a bounded buffer
(the oldest is dropped, and counted, when it is full). A healer that is down costs a counter.
"""

from __future__ import annotations

import logging
import math
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable

import msgspec

from exporters.ranks import RankState
from ground.httpclient import open_url
from ground.tls import PeerConnection, PeerTls
from wire.telemetry import HeartbeatBatch, RankEntry, encode_batch

HEARTBEAT_PATH = "/v1/heartbeats"

log = logging.getLogger(__name__)


def rank_summary(s: RankState) -> RankEntry:
    """One rank's entry in a heartbeat batch. JSON has no NaN: a non-finite loss or grad norm is null, and
    `nonfinite` says which it was, e.g. {"loss": "nan"}."""
    entry = RankEntry(job=s.job, rank=s.rank, pid=s.pid, local_rank=s.local_rank, world_size=s.world_size,
                      mesh=s.mesh, alive=s.alive, last_seen_age_s=round(s.age_seconds, 3), dropped=s.dropped,
                      events=dict(s.events), last_event=s.last_event, proc_state=s.proc_state)
    rec = s.last_step
    if rec is None:
        return entry
    return msgspec.structs.replace(
        entry, step=rec.step, step_time=rec.time, step_seconds=rec.step_seconds, phases=rec.phases,
        loss=_finite(rec.loss), grad_norm=_finite(rec.grad_norm),
        nonfinite={k: str(v) for k, v in (("loss", rec.loss), ("grad_norm", rec.grad_norm))
                   if v is not None and not math.isfinite(v)},
        tokens_per_second=rec.tokens_per_second, mfu=rec.mfu, dp_reduce_enter_ns=rec.dp_reduce_enter_ns,
        dp_reduce_lag_s=s.reduce_lag_seconds, max_rss_mib=rec.max_rss_mib,
        attempt=rec.attempt)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def urllib_post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    """POST and return the HTTP status; raises OSError (URLError included) when the healer cannot be reached."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with open_url(request, timeout=timeout_s) as response:  # noqa: S310 - URL from the operator
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


RELAY_RETRY_S = 30.0
"""How long batches go to the healer itself after the relay failed, before the relay is tried again."""


class HeartbeatForwarder:
    """Builds a batch every interval and posts it, oldest buffered first, without ever holding up the sidecar.
    `build(seq, sent_at)` makes the batch."""

    def __init__(
        self,
        healer_url: str,
        build: Callable[[int, float], HeartbeatBatch],
        interval_s: float = 1.0,
        buffer_batches: int = 60,
        token: str | None = None,
        post: Callable[[str, bytes, dict[str, str], float], int] = urllib_post,
        clock: Callable[[], float] = time.time,
        relay_url: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`tls`: this host's client context (ground/tls.py): batches then go over mutual TLS, to a peer whose
        certificate names the run's healer (or a relay, for `relay_url`), and the host's certificate is what the
        healer takes a batch's node from."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if buffer_batches < 1:
            raise ValueError(f"buffer_batches must be >= 1, got {buffer_batches}")
        self.url = healer_url.rstrip("/") + HEARTBEAT_PATH
        self.relay_url = relay_url.rstrip("/") + HEARTBEAT_PATH if relay_url else None
        """The node group's relay (exporters/relay.py): batches go there while it answers, else to the healer."""
        self._relay_down_until = 0.0
        self._relay_failures = 0
        self._build, self._post, self._clock, self._tls = build, post, clock, tls
        self._kept: dict[str, PeerConnection] = {}
        """Over TLS, one connection kept open to the healer and one to the relay (the handshake is paid once)."""
        self._interval_s = interval_s
        self._timeout_s = min(2.0, interval_s)
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._buffer: deque[bytes] = deque()
        self._buffer_max = buffer_batches
        self._seq = 0
        self.sent = 0
        self.last_taken_at: float | None = None
        """When a batch was last taken (time.monotonic()); None: none yet."""
        self.failures = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaheal-heartbeat", daemon=True)

    def retarget(self, healer_url: str) -> None:
        """Send to another healer from now on (one that took the job over)."""
        self.url = healer_url.rstrip("/") + HEARTBEAT_PATH

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self._timeout_s + 1)
        if not self._thread.is_alive():
            for kept in self._kept.values():
                kept.close()

    def nudge(self) -> None:
        """Send the next batch now, not at the end of the interval: something the healer acts on happened (a rank
        died). Nudges before that batch is built are one batch; the next interval counts from it."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - NOTE: a batch that cannot be built is skipped, never the thread's end
                log.error("building or sending a heartbeat batch failed", exc_info=True)

    def tick(self) -> None:
        """Queue this interval's batch, then send what the healer will take (at most 5 batches per tick)."""
        batch = self._build(self._seq, self._clock())
        self._seq += 1
        if len(self._buffer) >= self._buffer_max:
            self._buffer.popleft()
            self.dropped += 1
        self._buffer.append(encode_batch(batch))
        for _ in range(5):
            if not self._buffer or not self._send(self._buffer[0]):
                break
            self._buffer.popleft()

    def _send(self, body: bytes) -> bool:
        if self.relay_url is not None and self._clock() >= self._relay_down_until:
            sent = self._send_to(self.relay_url, "relay", body)
            if sent is not None:
                self._relay_failures = 0
                return sent
            # NOTE: past two failures in a row the batches go to the healer itself for RELAY_RETRY_S: a relay that is
            # down must not silence its whole node group (every host would read as lost).
            self._relay_failures += 1
            if self._relay_failures < 2:
                return False
            self._relay_down_until = self._clock() + RELAY_RETRY_S
            log.warning("relay %s failed %d times in a row: sending to the healer at %s for %.0f s",
                        self.relay_url, self._relay_failures, self.url, RELAY_RETRY_S)
        return bool(self._send_to(self.url, "healer", body))

    def _send_to(self, url: str, what: str, body: bytes) -> bool | None:
        """True: done with the batch (taken, or refused for good and dropped); None: not taken now (retry it)."""
        try:
            if self._tls is not None:
                kept = self._kept.setdefault(what, PeerConnection(PeerTls(self._tls, what)))
                status = kept.request("POST", url, body, self._headers, self._timeout_s, 4096)[0]
            else:
                status = self._post(url, body, self._headers, self._timeout_s)
        except (OSError, TimeoutError) as exc:
            self._failed(f"cannot reach the {what} at {url}: {exc}")
            return None
        if 200 <= status < 300:
            self.sent += 1
            self.last_taken_at = time.monotonic()
            return True
        if 400 <= status < 500 and status not in (408, 429):
            # Refused for good (bad schema, bad token): retrying it would never succeed.
            self._failed(f"the {what} at {url} refused a heartbeat batch with HTTP {status}; dropped")
            return True
        self._failed(f"the {what} at {url} answered HTTP {status}")
        return None

    def _failed(self, message: str) -> None:
        self.failures += 1
        # NOTE: one line per streak of failures, not one per second while the healer is down.
        if self.failures == 1 or self.failures % 300 == 0:
            log.warning("%s (failures so far: %d)", message, self.failures)
