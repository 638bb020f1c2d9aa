"""The sidecar's end of the rank socket: binds the AF_UNIX datagram socket and dispatches records.

NOTE: Linux queues at most net.unix.max_dgram_qlen datagrams (10 by default) on a receiving
socket before senders get EAGAIN (and drop). So the receiver drains everything queued in one go
and only then decodes, keeping the time between two reads of the socket short.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from exporters.schema import MAX_DATAGRAM_BYTES, Message, SchemaError, decode

log = logging.getLogger(__name__)


class SocketInUseError(RuntimeError):
    """Another live process already serves the socket path."""


def bind_datagram_socket(path: Path) -> socket.socket:
    """Bind `path`, replacing a stale socket file left by a dead sidecar but never a live one's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SocketInUseError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink()  # nobody reads it: a dead sidecar's leftover
        else:
            raise SocketInUseError(f"another sidecar is already serving {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    return sock


class DatagramReceiver:
    """Reads rank records from the socket on its own thread and hands each decoded one to `on_message`."""

    def __init__(self, path: Path, on_message: Callable[[Message], None], poll_s: float = 0.2) -> None:
        self.path = path
        self._on_message = on_message
        self._sock = bind_datagram_socket(path)
        self._sock.setblocking(False)
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaheal-receiver", daemon=True)
        self.received = 0
        self.malformed = 0
        self._warned = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._drain()
            for data in batch:
                self.handle(data)

    def _drain(self) -> list[bytes]:
        """Wait up to poll_s for the socket to be readable, then take every datagram already queued."""
        try:
            readable, _, _ = select.select([self._sock], [], [], self._poll_s)
        except (OSError, ValueError):
            if self._stop.is_set():
                return []  # closed under us while stopping
            raise
        batch: list[bytes] = []
        while readable and len(batch) < 1024:
            try:
                batch.append(self._sock.recv(MAX_DATAGRAM_BYTES + 1))
            except (BlockingIOError, InterruptedError):
                break
        return batch

    def handle(self, data: bytes) -> None:
        """Decode one datagram and dispatch it; a bad one is counted (and logged once), never fatal."""
        self.received += 1
        try:
            message = decode(data)
        except SchemaError as exc:
            self.malformed += 1
            if not self._warned:
                self._warned = True
                log.warning("rejected a rank datagram (%s); further rejections are only counted", exc)
            return
        self._on_message(message)
