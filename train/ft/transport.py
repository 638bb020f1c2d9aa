"""A replica group's live state, handed to a replica that joins the quorum behind, only between holders of the run's
key: torchft's checkpoint transport, authenticated.

torchft 0.2.0's own HTTP transport serves the state to whoever asks and loads what a peer serves with
`torch.load(weights_only=False)`, and the address a joining replica fetches from comes through the Lighthouse and
the peer's manager server, neither of which authenticates anyone. So whoever reaches the Lighthouse could name
itself the recovery source and run code in every replica that heals from it, and read the model's weights. Here:
- the state is served only to a request carrying an HMAC-SHA256 under the run's key of the step and a time within
  `MAX_SKEW_S` (a request without the key gets 403, and nothing of the state);
- the state travels with an HMAC under the same key of the step and the bytes, checked before anything is parsed;
- it is parsed with `torch.load(weights_only=True)`: tensors, numbers, strings, lists and dicts (what a model's,
  an optimizer's and torchft's own state dicts hold), never an arbitrary object;
- it is served from the address the replica's host trains on (`bind`), not every interface.

Written by hand (http.server, hmac from the standard library) because torchft's transport is the part that does not
fit: its interface (`CheckpointTransport`) is kept, so the Manager uses this one as it would its own.

    GET /state/<step>    X-Megaheal-Auth: <unix time>:<hex HMAC(key, b"megaheal ft get v1\\0" + step + b"\\0" + time)>
    200                  X-Megaheal-Seal: <hex HMAC(key, b"megaheal ft state v1\\0" + step + b"\\0" + body)>
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, TypeVar

import torch
from torchft.checkpointing.transport import CheckpointTransport

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_SKEW_S = 60.0
"""How far a request's time may be from the server's: a captured request is good for no longer (hosts of one job
keep their clocks within a second; node-health checks it)."""
_GET = b"megaheal ft get v1\0"
_STATE = b"megaheal ft state v1\0"


class TransportError(RuntimeError):
    """The state could not be had from the peer, or what came was not sealed with the run's key."""


def _mac(key: bytes, context: bytes, step: int, payload: bytes) -> str:
    return hmac.new(key, context + str(step).encode() + b"\0" + payload, hashlib.sha256).hexdigest()


def request_auth(key: bytes, step: int, now: float) -> str:
    """The X-Megaheal-Auth header of a request for the state of `step` at time `now`."""
    stamp = f"{now:.3f}"
    return f"{stamp}:{_mac(key, _GET, step, stamp.encode())}"


def request_allowed(key: bytes, step: int, header: str | None, now: float) -> bool:
    """Whether `header` (X-Megaheal-Auth) was made with `key` for `step` within MAX_SKEW_S of `now`."""
    stamp, _, mac = (header or "").partition(":")
    try:
        sent = float(stamp)
    except ValueError:
        return False
    # NOTE: compared as bytes: compare_digest refuses a str that is not ASCII (a header is anyone's to write)
    return abs(now - sent) <= MAX_SKEW_S and hmac.compare_digest(mac.encode(), _mac(key, _GET, step,
                                                                                     stamp.encode()).encode())


def seal_state(key: bytes, step: int, body: bytes) -> str:
    return _mac(key, _STATE, step, body)


def open_state(key: bytes, step: int, body: bytes, seal: str | None) -> Any:
    """The state in `body` if `seal` is its seal under `key` for `step`; TransportError otherwise (nothing parsed)."""
    if not seal or not hmac.compare_digest(seal.encode(), seal_state(key, step, body).encode()):
        raise TransportError(f"the state of step {step} is not sealed with this run's key: refused unread")
    return torch.load(io.BytesIO(body), weights_only=True)


class SignedTransport(CheckpointTransport[T], Generic[T]):
    """torchft's CheckpointTransport between holders of `key`: serves this replica's state to peers that ask with
    the key, from `bind` (the host's training address), and takes a peer's only sealed with it."""

    def __init__(self, key: bytes, bind: str, timeout: timedelta) -> None:
        if len(key) < 16:
            raise ValueError(f"the run's key must be at least 16 bytes, got {len(key)}")
        self._key = key
        self._timeout = timeout
        self._lock = threading.Lock()
        self._served: tuple[int, bytes, str] | None = None
        """(step, body, seal) while a peer may fetch it (send_checkpoint to disallow_checkpoint)."""
        self._server = ThreadingHTTPServer((bind, 0), self._handler())
        self._server.daemon_threads = True
        self._address = f"http://{bind}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="megaheal-ft-state", daemon=True)
        self._thread.start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                prefix = "/state/"
                step_text = self.path[len(prefix):] if self.path.startswith(prefix) else ""
                if not step_text.isdigit():
                    self.send_error(404)
                    return
                step = int(step_text)
                if not request_allowed(transport._key, step, self.headers.get("X-Megaheal-Auth"), time.time()):
                    self.send_error(403)
                    return
                with transport._lock:
                    served = transport._served
                if served is None or served[0] != step:
                    self.send_error(404, f"no state of step {step} here")
                    return
                _, body, seal = served
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Megaheal-Seal", seal)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("ft state server: " + format, *args)

        return Handler

    def metadata(self) -> str:
        return self._address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        buf = io.BytesIO()
        torch.save(state_dict, buf)
        body = buf.getvalue()
        with self._lock:
            self._served = (step, body, seal_state(self._key, step, body))

    def disallow_checkpoint(self) -> None:
        with self._lock:
            self._served = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        if not metadata.startswith("http://"):
            raise TransportError(f"replica rank {src_rank}'s state address is not http://...: {metadata[:80]!r}")
        request = urllib.request.Request(f"{metadata}/state/{step}",
                                         headers={"X-Megaheal-Auth": request_auth(self._key, step, time.time())})
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                with urllib.request.urlopen(request, timeout=max(1.0, deadline - time.monotonic())) as response:
                    body, seal = response.read(), response.headers.get("X-Megaheal-Seal")
                break
            except urllib.error.HTTPError as exc:
                # NOTE: 404 until the peer has staged this step's state (its quorum thread may be a moment behind).
                if exc.code != 404 or time.monotonic() >= deadline:
                    raise TransportError(f"replica rank {src_rank} at {metadata}: HTTP {exc.code} for the state of "
                                         f"step {step}") from exc
                time.sleep(0.05)
            except (urllib.error.URLError, OSError) as exc:
                raise TransportError(f"replica rank {src_rank} at {metadata}: {exc}") from exc
        return open_state(self._key, step, body, seal)  # type: ignore[no-any-return]

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=5)
