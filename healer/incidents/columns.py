"""Column types that make every text value fit before it reaches the database, whatever it came from (an alert's
labels, a heartbeat's job name, a person's name, a runbook's summary).

Why at the column and not at each input: PostgreSQL refuses a value longer than its VARCHAR(n) and any text
holding a NUL character, and that refusal used to surface as "database unavailable" (503) for one bad label, so
Alertmanager retried the whole batch for ever. SQLite accepts both silently, which is how it went unnoticed.
Applied at bind time, the fix covers inserts, updates and WHERE clauses alike, so a value clipped on the way in
still finds its row on the way back (`Job.name == long_name` compares the clipped forms).

Clipping keeps values distinct: a value too long keeps its start and ends with "~" and a short hash of the whole,
so two long job names that share their first 200 characters stay two jobs.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import String, Text, TypeDecorator
from sqlalchemy.engine import Dialect

_HASH_CHARS = 12


def fit(value: str, limit: int | None) -> str:
    """`value` without NUL characters and, past `limit` characters, clipped to exactly `limit` (see above)."""
    if "\x00" in value:
        value = value.replace("\x00", "")
    if limit is None or len(value) <= limit:
        return value
    digest = hashlib.blake2b(value.encode(errors="surrogatepass"), digest_size=_HASH_CHARS // 2).hexdigest()
    return f"{value[: limit - _HASH_CHARS - 1]}~{digest}"


class Label(TypeDecorator[str]):
    """VARCHAR(length) whose values are made to fit (NUL removed, clipped keeping them distinct)."""

    impl = String
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        return fit(value, getattr(self.impl_instance, "length", None)) if isinstance(value, str) else value


class Prose(TypeDecorator[str]):
    """TEXT without NUL characters (PostgreSQL's text cannot hold them)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        return fit(value, None) if isinstance(value, str) else value
