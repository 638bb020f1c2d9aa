"""The sidecar's end of the rank socket: binds the AF_UNIX datagram socket and dispatches records.

Only the sidecar's own user can reach the socket and be heard on it: its directory is the user's alone
(created 0700; an existing one must belong to the user and be writable by nobody else, or another user could
replace the socket), the socket file is 0600, and every datagram is checked against the kernel's credentials
of its sender (exporters/peers.py). What is refused is counted, never fatal.

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
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from exporters.peers import CREDENTIALS_SPACE, Credentials, SenderPolicy, credentials, pass_credentials
from wire.telemetry import MAX_DATAGRAM_BYTES, Message, SchemaError, decode

log = logging.getLogger(__name__)


class SocketInUseError(RuntimeError):
    """Another live process already serves the socket path."""


class UnsafeSocketDirError(RuntimeError):
    """The socket's directory is not this user's alone, so someone else could replace or reach the socket."""


def private_directory(directory: Path) -> None:
    """Create `directory` 0700 (its parents as usual), or check that the existing one is ours and that nobody else
    can write to it. Never loosens or tightens an existing directory itself: it may be shared on purpose (/tmp)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)  # NOTE: lstat: a symlink planted in place of the directory is refused, not followed
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketDirError(f"socket directory {directory} is not a directory (a symlink or a file): refused")
    if st.st_uid != os.geteuid():
        raise UnsafeSocketDirError(
            f"socket directory {directory} belongs to uid {st.st_uid}, not to uid {os.geteuid()} that this sidecar "
            "runs as: its owner could replace the socket. Use a directory of your own (or remove that one)")
    if st.st_mode & 0o022:
        raise UnsafeSocketDirError(
            f"socket directory {directory} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): they could "
            f"replace the socket. chmod 700 {directory}, or use a directory of your own")


def bind_datagram_socket(path: Path) -> socket.socket:
    """Bind `path` in a private directory (see private_directory), replacing a stale socket file left by a dead
    sidecar but never a live one's. The socket receives its senders' credentials and only its user may write."""
    private_directory(path.parent)
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
    pass_credentials(sock)
    sock.bind(str(path))
    os.chmod(path, 0o600)
    return sock


class DatagramReceiver:
    """Reads rank records from the socket on its own thread and hands each decoded one to `on_message`."""

    def __init__(self, path: Path, on_message: Callable[[Message], None], poll_s: float = 0.2,
                 policy: SenderPolicy | None = None) -> None:
        self.path = path
        self._on_message = on_message
        self._policy = policy or SenderPolicy()
        # NOTE: a directory this receiver made is removed with the socket (the node agent's is one per host and work
        # directory under the temp directory: hundreds were left behind by a day of test runs).
        self._made_dir = not path.parent.exists()
        self._sock = bind_datagram_socket(path)
        self._sock.setblocking(False)
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaheal-receiver", daemon=True)
        self.received = 0
        self.malformed = 0
        self.refused: Counter[str] = Counter()
        """Datagrams refused for who sent them, by reason (exporters/peers.py)."""
        self._warned: set[str] = set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # NOTE: a sidecar whose start failed stops a receiver never started
            self._thread.join(timeout=5)
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._made_dir:
            try:
                self.path.parent.rmdir()
            except OSError:
                pass  # not empty (a newer sidecar's socket is in it), or gone already

    @property
    def rejected_senders(self) -> int:
        return sum(self.refused.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._drain()
            for data, creds in batch:
                self.handle(data, creds)

    def _drain(self) -> list[tuple[bytes, Credentials | None]]:
        """Wait up to poll_s for the socket to be readable, then take every datagram already queued."""
        try:
            readable, _, _ = select.select([self._sock], [], [], self._poll_s)
        except (OSError, ValueError):
            if self._stop.is_set():
                return []  # closed under us while stopping
            raise
        batch: list[tuple[bytes, Credentials | None]] = []
        while readable and len(batch) < 1024:
            try:
                data, ancdata, _, _ = self._sock.recvmsg(MAX_DATAGRAM_BYTES + 1, CREDENTIALS_SPACE)
            except (BlockingIOError, InterruptedError):
                break
            batch.append((data, credentials(ancdata)))
        return batch

    def handle(self, data: bytes, creds: Credentials | None) -> None:
        """Check the sender, decode one datagram and dispatch it; a refused or bad one is counted (and logged once
        per reason), never fatal."""
        self.received += 1
        refusal = self._policy.refuse_sender(creds)
        if refusal is not None:
            self._refuse(*refusal)
            return
        try:
            message = decode(data)
        except SchemaError as exc:
            self.malformed += 1
            self._warn_once("malformed", f"rejected a rank datagram ({exc})")
            return
        refusal = self._policy.refuse_claim(creds.pid if creds else 0, message.pid)
        if refusal is not None:
            self._refuse(*refusal)
            return
        self._on_message(message)

    def _refuse(self, reason: str, why: str) -> None:
        self.refused[reason] += 1
        self._warn_once(reason, f"refused a rank datagram: {why}")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s; further ones are only counted", message)
