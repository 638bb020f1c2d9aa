"""Sealed values in a warm pool's store: only a holder of the pool's key can write a value its readers take.

A TCPStore takes reads and writes from any client that reaches its port, without credentials, and a plan says which
generation a worker joins and where it resumes from (loading a checkpoint unpickles). So every value the pool (or
the healer) and its workers write there is sealed with an HMAC-SHA256 under a key of the pool, and every read
checks it: a value whose seal fails is treated as absent (logged once per value, naming the key, and counted in
`SealedStore.refused`), never parsed.

    v1.<64 hex digits: HMAC-SHA256(pool key, b"megaheal warm v1\\0" + store key + b"\\0" + value)>.<value>

The store key is inside the MAC, so a valid value cannot be replayed under another key; the generation is part of
every generation's key (`warm/plan/<g>`, `warm/ready/<g>/<worker>`, `warm/end/<g>/<worker>`) and is `warm/gen`'s
value, so a value of one generation cannot pass for another's. What is sealed is not secret: any client can read it.
Nor does a seal stop a client from deleting or overwriting values (the pool then waits or fails, it never runs what
the client chose).

The key: a pool started alone (train/warm/pool.py) makes a random one; under node agents the healer and every agent
derive the same one from the run's token, which they both hold (`pool_key`), so no new secret is distributed.
Workers read it from a file of mode 0600 whose path they are given (never the key itself: a command line and an
environment are readable through /proc).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from pathlib import Path
from typing import Protocol

from ground.secretfile import SecretError, read_secret, replace_private

log = logging.getLogger(__name__)

VERSION = b"v1."
_CONTEXT = b"megaheal warm v1\0"
_MAC_HEX = 64
KEY_BYTES = 32


def _mac(secret: bytes, key: str, value: bytes) -> bytes:
    return hmac.new(secret, _CONTEXT + key.encode() + b"\0" + value, hashlib.sha256).hexdigest().encode()


def seal(secret: bytes, key: str, value: str) -> str:
    """`value` as written under store key `key`, sealed with the pool's key `secret`."""
    return f"{VERSION.decode()}{_mac(secret, key, value.encode()).decode()}.{value}"


def unseal(secret: bytes, key: str, data: bytes) -> str | None:
    """The value sealed in `data` if it was sealed with `secret` for store key `key`; else None."""
    head = len(VERSION) + _MAC_HEX
    if not data.startswith(VERSION) or data[head:head + 1] != b".":
        return None
    raw = data[head + 1:]
    if not hmac.compare_digest(data[len(VERSION):head], _mac(secret, key, raw)):
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


# ---- the key --------------------------------------------------------------------------------------------------


def pool_key(token: str, pool: str) -> bytes:
    """The key of warm pool `pool` (its run id, wire/run_ids.pool_run_id) of a run whose token is `token`: what the
    healer and each node agent compute alike. A pool formed in another attempt has another key."""
    return hmac.new(token.encode(), b"megaheal warm plan key\0" + pool.encode(), hashlib.sha256).digest()


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def write_key(path: Path, secret: bytes) -> Path:
    """The pool's key in a new file of mode 0600 at `path` (whatever was there is replaced, a link not followed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_private(path, secret.hex() + "\n")
    return path


def read_key(path: str | Path, what: str = "warm pool key") -> bytes:
    """The key write_key left at `path`, after checking the file is this user's and private (SecretError)."""
    text = read_secret(path, what, private=True)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != KEY_BYTES:
        raise SecretError(f"{path}: not a {what} ({KEY_BYTES * 2} hex digits)")
    return secret


# ---- a store whose values are sealed --------------------------------------------------------------------------


class Store(Protocol):
    """What is used of a torch.distributed store (TCPStore, PrefixStore)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


class SealedStore:
    """A client of a pool's store that seals what it writes and takes only sealed values. NOTE: one per thread, as
    a store client is."""

    def __init__(self, store: Store, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("a warm pool key has at least 16 bytes")
        self.store, self._secret = store, secret
        self.refused: dict[str, int] = {}
        """store key -> how many distinct values under it were refused (not sealed with the pool's key)."""
        self._last_refused: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.store.set(key, seal(self._secret, key, value))

    def get(self, key: str) -> str | None:
        """The value under `key`; None when there is none, or when it is not sealed with the pool's key."""
        if not self.store.check([key]):
            return None
        data = self.store.get(key)
        value = unseal(self._secret, key, data)
        if value is None and self._last_refused.get(key) != data:
            self._last_refused[key] = data
            self.refused[key] = self.refused.get(key, 0) + 1
            log.warning("warm store: the value under %s is refused: it is not sealed with this pool's key (a client "
                        "without it wrote it)", key)
        return value

    def has(self, key: str) -> bool:
        return self.get(key) is not None
