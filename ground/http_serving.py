"""uvicorn's HTTP/1.1 protocol with what it lacks against a client that holds connections open.

uvicorn counts every open connection, idle ones too, toward `limit_concurrency`, past which each new request is
answered 503, and it gives a connection that never sends a request no deadline. In a review of main, one client's
1005 idle connections kept the healer's report endpoint answering 503 for 25 s and more, and every host looked
lost. `guarded_h11` returns a protocol class for `uvicorn.Config(http=...)` that adds two things:
- a deadline for a connection's first request (`header_deadline_s`): a connection silent past it is closed;
- at most `per_peer` open connections from one address: one past it is closed as it is made.
A sidecar or an agent holds one or two connections to the healer; `per_peer` is far above that, and far below
`limit_concurrency`.
Served over TLS (`tls_config`), each request's ASGI scope also holds the identity the peer's certificate proved
(ground/tls.py `peer_of`), for the routes that need to know which host is speaking.

Why by hand: uvicorn has neither (its `timeout_keep_alive` starts only after a first response), and a reverse proxy
in front of every node agent is more than a cluster operator should have to run.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from ground.tls import PEER_KEY, Identity, identity_of

PER_PEER = 64
HEADER_DEADLINE_S = 10.0


def guarded_h11(per_peer: int = PER_PEER, header_deadline_s: float = HEADER_DEADLINE_S) -> type[H11Protocol]:
    """A protocol class for one server (its own count of connections by peer)."""
    if per_peer < 1 or header_deadline_s <= 0:
        raise ValueError(f"per_peer must be >= 1 and header_deadline_s > 0, got {per_peer}, {header_deadline_s}")
    open_by_peer: Counter[str] = Counter()

    class GuardedH11(H11Protocol):
        _peer: str | None = None
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._peer = str(self.client[0]) if self.client else "?"
            open_by_peer[self._peer] += 1
            if open_by_peer[self._peer] > per_peer:
                transport.close()  # NOTE: connection_lost follows, and counts it out
                return
            self._deadline = self.loop.call_later(header_deadline_s, self._silent)
            tls = transport.get_extra_info("ssl_object")
            if tls is not None:
                self.app = _with_peer(self.app, identity_of(tls.getpeercert()))

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self._deadline is not None:
                self._deadline.cancel()  # a request came: uvicorn's own keep-alive timeout takes over after it
                self._deadline = None

        def _silent(self) -> None:
            self._deadline = None
            if self.cycle is None and self.transport is not None:
                self.transport.close()

        def connection_lost(self, exc: Any) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            if self._peer is not None:
                open_by_peer[self._peer] -= 1
                if open_by_peer[self._peer] <= 0:
                    del open_by_peer[self._peer]
                self._peer = None
            super().connection_lost(exc)

    return GuardedH11


def _with_peer(app: Any, peer: Identity | None) -> Any:
    """`app`, with the connection's proven peer in every request's scope (None: it sent no certificate)."""
    async def with_peer(scope: Any, receive: Any, send: Any) -> None:
        scope[PEER_KEY] = peer
        await app(scope, receive, send)
    return with_peer


def tls_config(context: Any) -> dict[str, Any]:
    """uvicorn.Config arguments that serve over `context` (an ssl.SSLContext made by ground/tls.py)."""
    return {"ssl_context_factory": lambda config, default: context}


def listening_socket(listen: str) -> socket.socket:
    """A socket bound to HOST:PORT (`[v6]:PORT` too; port 0: any) for uvicorn's `sockets=`, with TCP_NODELAY.
    NOTE: asyncio sets TCP_NODELAY on the sockets it accepts for plain transports but not under its SSL transport,
    where uvicorn writes a response's head and body as two records: Nagle then held the body back until the client's
    delayed ACK, 40 ms on every request over TLS (bench/control_tls.py). Linux gives accepted sockets the listening
    socket's option."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"listen must be HOST:PORT, got {listen!r}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, int(port)))
    return sock
