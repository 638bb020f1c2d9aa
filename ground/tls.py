"""Mutual TLS between a run's healer and its hosts, on Python's ssl module with the files a run's authority wrote
(healer/launchers/run_authority.py makes them with the `cryptography` package).

Every party holds one directory of three files: `ca.pem` (the run's certificate authority, and nothing else is
trusted), `cert.pem` and `key.pem` (its own certificate and key, the key readable by its owner only). A certificate
names its holder in a subject alternative name `urn:megaheal:ROLE:NAME`: the healer (`healer:healer`), each host
(`host:NODE`) and each relay (`relay:NAME`). A connection is trusted when the peer's chain ends in the run's CA *and*
it names who was meant: the healer asks for `host:n2` when it orders n2's agent, an agent takes orders only from
`healer:*`, and the healer takes n2's heartbeat batch only from `host:n2`.

NOTE: the identity is checked after the handshake, by role and name, not by hostname: an agent's certificate is
issued before the host's address is known (Slurm picks it), and the address says nothing about which host the peer
is. The chain is still verified in the handshake (CERT_REQUIRED, the run's CA only).
"""

from __future__ import annotations

import http.client
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

ROLES = ("healer", "host", "relay")
URN = "urn:megaheal:"
PEER_KEY = "megaheal.peer"
"""Where a TLS server's ASGI scope holds the peer's Identity (ground/http_serving.py puts it there)."""


class PeerRefused(ConnectionError):
    """The peer's certificate is the run's, but names someone else than the one asked for."""


@dataclass(frozen=True, slots=True)
class Identity:
    role: str
    name: str

    @property
    def urn(self) -> str:
        return f"{URN}{self.role}:{self.name}"

    def __str__(self) -> str:
        return f"{self.role} {self.name}"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """One party's directory: the run's CA, its certificate and its key."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def cert(self) -> Path:
        return self.directory / "cert.pem"

    @property
    def key(self) -> Path:
        return self.directory / "key.pem"

    def check(self) -> TlsFiles:
        """These files, when all three are there; ValueError naming the one missing otherwise."""
        for path in (self.ca, self.cert, self.key):
            if not path.is_file():
                raise ValueError(f"TLS: {path} is missing (a run's authority writes ca.pem, cert.pem and key.pem)")
        return self

    def server(self, require_peer: bool = True) -> ssl.SSLContext:
        """A server's context: its own certificate; a client's certificate from the run's CA, required or, with
        `require_peer=False`, verified when one is sent (a person with the token and no certificate reads incidents)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._common(ctx)
        ctx.verify_mode = ssl.CERT_REQUIRED if require_peer else ssl.CERT_OPTIONAL
        return ctx

    def client(self) -> ssl.SSLContext:
        """A client's context: its own certificate, and only a server from the run's CA (identity checked after the
        handshake, see the module's NOTE)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        self._common(ctx)
        return ctx

    def _common(self, ctx: ssl.SSLContext) -> None:
        self.check()
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # NOTE: both ends are megaheal's: no older protocol to meet
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(cafile=self.ca)


def identity_of(cert: dict[str, Any] | None) -> Identity | None:
    """The megaheal identity a verified peer certificate (ssl's getpeercert() dict) names; None without one."""
    if not cert:
        return None
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "URI" and isinstance(value, str) and value.startswith(URN):
            role, sep, name = value[len(URN):].partition(":")
            if sep and role in ROLES and name:
                return Identity(role, name)
    return None


def peer_of(scope: Mapping[str, Any]) -> Identity | None:
    """The identity a TLS server's connection proved (None: plain HTTP, or no certificate sent)."""
    peer = scope.get(PEER_KEY)
    return peer if isinstance(peer, Identity) else None


@dataclass(frozen=True, slots=True)
class PeerTls:
    """How a client reaches one peer: the run's client context, and who the peer must be (`name` None: any holder
    of `role`)."""

    context: ssl.SSLContext
    role: str
    name: str | None = None

    def check(self, sock: ssl.SSLSocket) -> Identity:
        peer = identity_of(sock.getpeercert())
        if peer is None or peer.role != self.role or (self.name is not None and peer.name != self.name):
            wanted = f"{self.role} {self.name}" if self.name else f"a {self.role}"
            raise PeerRefused(f"the peer's certificate names {peer or 'no megaheal identity'}, not {wanted}")
        return peer


def https(method: str, url: str, body: bytes | None, headers: dict[str, str], timeout_s: float, peer: PeerTls,
          max_response: int) -> tuple[int, bytes]:
    """One request over a new TLS connection to `peer` (checked before anything is sent): (status, body). OSError
    (PeerRefused and ssl errors included) when there is no answer from the right peer."""
    connection = PeerConnection(peer)
    try:
        return connection.request(method, url, body, headers, timeout_s, max_response)
    finally:
        connection.close()


class PeerConnection:
    """A TLS connection to one peer kept open between requests, for a client that asks it again and again (a host's
    heartbeat batches): the handshake, about 2.8 ms of CPU at the two ends together (bench/control_tls.py: 3.27 ms a
    request on a new connection against 0.48 ms on a kept one), is paid once, not per request. The peer's identity is checked on every new connection. One thread at a time.

    NOTE: http.client rather than urllib: the peer's identity must be checked on the socket between the handshake
    and the request, and redirects are never followed either way."""

    def __init__(self, peer: PeerTls) -> None:
        self.peer = peer
        self._conn: http.client.HTTPSConnection | None = None
        self._where: tuple[str, int] | None = None

    def request(self, method: str, url: str, body: bytes | None, headers: dict[str, str], timeout_s: float,
                max_response: int) -> tuple[int, bytes]:
        """(status, body). A kept connection the peer closed meanwhile (its keep-alive ran out) is opened again and
        the request sent once more: only then, when nothing came back on it. OSError when there is no answer."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            raise ValueError(f"{url}: a TLS peer needs an https:// URL")
        where = (parts.hostname, parts.port or 443)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        reused = self._conn is not None and self._where == where
        if not reused:
            self._open(where, timeout_s)
        try:
            return self._send(method, target, body, headers, timeout_s, max_response)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            if not reused or isinstance(exc, (TimeoutError, ssl.SSLCertVerificationError, PeerRefused)):
                _fail(method, url, exc)
        self._open(where, timeout_s)
        try:
            return self._send(method, target, body, headers, timeout_s, max_response)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            _fail(method, url, exc)

    def _open(self, where: tuple[str, int], timeout_s: float) -> None:
        self.close()
        conn = http.client.HTTPSConnection(where[0], where[1], timeout=timeout_s, context=self.peer.context)
        try:
            conn.connect()
            assert isinstance(conn.sock, ssl.SSLSocket)
            self.peer.check(conn.sock)
        except BaseException:  # NOTE: cleanup only (no socket left open on any failure, Ctrl-C included): re-raised
            conn.close()
            raise
        self._conn, self._where = conn, where

    def _send(self, method: str, target: str, body: bytes | None, headers: dict[str, str], timeout_s: float,
              max_response: int) -> tuple[int, bytes]:
        assert self._conn is not None and self._conn.sock is not None
        self._conn.sock.settimeout(timeout_s)
        self._conn.request(method, target, body=body, headers=headers)
        response = self._conn.getresponse()
        data = response.read(max_response)
        if response.will_close or not response.isclosed():
            self.close()  # the peer ends it, or the answer was longer than taken: never reuse a half-read stream
        return response.status, data

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self._where = None, None


def _fail(method: str, url: str, exc: BaseException) -> NoReturn:
    """Raise `exc` as an OSError: itself, or a ConnectionError saying what http.client found wrong."""
    if isinstance(exc, OSError):
        raise exc
    raise ConnectionError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
