"""The rank client: hands each rank's records to the node's sidecar without ever slowing training.

Used by the trainer on every rank:

    client = RankClient.from_env(job, rank, local_rank, world_size, {"pp": 0, "dp": 1, "tp": 0})
    client.hello()
    client.step(record)            # after each step, the same dict that goes to the JSON lines
    client.event("exception", type="RuntimeError", message="...")
    client.close()

Records go out as datagrams (wire/telemetry.py, schema v2) on a non-blocking AF_UNIX socket to the
path in MEGAHEAL_SIDECAR_SOCKET. Each is validated against the schema here, so a bad record is dropped at
the rank, counted, and never costs the sidecar a decode. When the sidecar is slow (its queue is full),
gone, or not started yet, the record is dropped and counted in `dropped`; nothing here blocks, and
nothing raises into the caller. With the variable unset, `from_env` returns a NullRankClient that does
nothing. The standard library and msgspec only: the trainer must not pay for the sidecar's dependencies.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from wire import rank_env
from wire.telemetry import MAX_DATAGRAM_BYTES, build_record, encode

SOCKET_ENV = rank_env.SIDECAR_SOCKET

log = logging.getLogger(__name__)


class RankClient:
    """Sends hello, step and event records of one rank to its node's sidecar; drops when it cannot."""

    def __init__(
        self, path: str, job: str, rank: int, local_rank: int, world_size: int, mesh: Mapping[str, int],
        node: str | None = None,
    ) -> None:
        self.path = path
        self.job, self.rank, self.pid = job, rank, os.getpid()
        self._hello = {"local_rank": local_rank, "node": node or socket.gethostname(), "world_size": world_size,
                       "mesh": dict(mesh)}
        self.dropped = 0  # records that could not be sent (sidecar absent or behind, record unsendable)
        self.sent = 0
        # The sidecar may (re)start at any time: after a failed send, greet it again before the next record.
        self._greeted = False
        self._warned: set[str] = set()
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    @classmethod
    def from_env(
        cls, job: str, rank: int, local_rank: int, world_size: int, mesh: dict[str, int],
        environ: Mapping[str, str] | None = None,
    ) -> RankClient:
        """A client for the sidecar socket named by MEGAHEAL_SIDECAR_SOCKET; a NullRankClient when it is unset."""
        path = (os.environ if environ is None else environ).get(SOCKET_ENV, "")
        if not path:
            return NullRankClient()
        return cls(path, job, rank, local_rank, world_size, mesh)

    # ------------------------------------------------------------ records

    def hello(self) -> None:
        """Introduce this rank (also re-sent on its own after the sidecar comes back)."""
        self._greeted = self._send("hello", self._hello)

    def step(self, record: Mapping[str, Any]) -> None:
        """Send one step record, the trainer's per-step dict (its keys outside StepBody stay in the JSON lines),
        tagged with the attempt MEGAHEAL_ATTEMPT names as it is sent."""
        # NOTE: read at each send, not once: a warm worker's process (and this client, under megaheal.rank) lives
        # through several attempts, and its generation loop sets the variable as each one begins.
        attempt = os.environ.get(rank_env.ATTEMPT, "")
        self._send_record("step", {**record, "attempt": int(attempt)} if attempt.isdigit() else record)

    def event(self, kind: str, **fields: Any) -> None:
        """Send an event, e.g. event("checkpoint_saved", step=100) or event("exception", type=..., message=...)."""
        self._send_record("event", {"name": kind, "time": time.time(), "fields": fields})

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # ------------------------------------------------------------ sending

    def _send_record(self, kind: str, body: Mapping[str, Any]) -> None:
        if not self._greeted:
            # A re-greeting is not the caller's record: its failure is not counted as a drop.
            self._greeted = self._send("hello", self._hello, count=False)
            if not self._greeted:
                self.dropped += 1  # the sidecar is still away: the record would fail the same way
                return
        if not self._send(kind, body):
            self._greeted = False

    def _send(self, kind: str, body: Mapping[str, Any], count: bool = True) -> bool:
        """One datagram; True unless the sidecar is unreachable. Failures are counted (if `count`), never raised."""
        if self._sock is None:
            self.dropped += count
            return False
        try:
            data = encode(build_record(kind, self.job, self.rank, self.pid, self.dropped, body))
        except (msgspec.ValidationError, TypeError, OverflowError) as exc:
            self._warn_once(f"encode-{kind}", f"a {kind} record does not fit the wire schema ({exc}); dropping such "
                                              "records")
            self.dropped += count
            return True  # the sidecar is fine; only this record was bad
        if len(data) > MAX_DATAGRAM_BYTES:
            self._warn_once("size", f"a {kind} record of {len(data)} bytes exceeds {MAX_DATAGRAM_BYTES}; dropped")
            self.dropped += count
            return True
        try:
            self._sock.sendto(data, self.path)
        except (BlockingIOError, InterruptedError):
            # The sidecar's queue is full: it is alive but behind. Drop rather than wait.
            self.dropped += count
            return True
        except (FileNotFoundError, ConnectionRefusedError):
            # No sidecar at the path (not started, restarting, or gone): expected, counted, quiet.
            self.dropped += count
            return False
        except OSError:
            self._warn_once("oserror", f"cannot send to the sidecar at {self.path}", True)
            self.dropped += count
            return False
        self.sent += 1
        return True

    def _warn_once(self, key: str, message: str, exc_info: bool = False) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("rank %d telemetry: %s", self.rank, message, exc_info=exc_info)


class NullRankClient(RankClient):
    """The client of a rank without a sidecar: every call does nothing."""

    def __init__(self) -> None:  # noqa: D107 - no socket, no state beyond the counters
        self.path = ""
        self.job, self.rank, self.pid = "", 0, os.getpid()
        self.dropped = 0
        self.sent = 0
        self._sock = None

    def hello(self) -> None:
        pass

    def step(self, record: Mapping[str, Any]) -> None:
        pass

    def event(self, kind: str, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass
