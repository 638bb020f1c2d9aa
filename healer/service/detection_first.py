"""Heartbeats wait while a detection cycle reads: the cycle gets the interpreter to itself.

The service takes heartbeats on its event loop and detects on a thread of its own, one Python process. With one
interpreter lock the two take turns: at 131,072 ranks ingest keeps the lock ~0.6 of every second, and a cycle that
takes ~40 ms alone took ~95 ms beside it, some ~250-500 ms (bench/healer_ingest.py). A heartbeat loses nothing by
waiting that long (the next cycle reads it either way: the running one reads the snapshot it took when it
started), but every finding of the cycle waits for the cycle. So while a cycle evaluates its detectors, the
heartbeat routes read their bodies and then wait for it to end, at most `max_wait_s` (past that they go on: a
cycle that long must not hold the nodes' batches up without bound). The writes a cycle leads to (incidents in the
database) are not waited for.

Only the event loop's thread opens, closes and waits (an asyncio.Event is not thread-safe): the detection thread
reopens it through `loop.call_soon_threadsafe(gate.open)`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter

MAX_WAIT_S = 0.5
"""The longest a heartbeat waits for a cycle (a cycle is ~30-100 ms at 131,072 ranks). NOTE: well inside the
senders' own timeout (exporters/heartbeat.py: the interval, at most 2 s; 1 s by default), so that a held request
is never one they gave up on."""


class DetectionFirst:
    def __init__(self, held: Counter, past_limit: Counter, max_wait_s: float = MAX_WAIT_S) -> None:
        """`held` counts the seconds requests waited (each request's wait once); `past_limit` the requests that
        waited max_wait_s and went on while a cycle still ran."""
        if max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        self.max_wait_s = max_wait_s
        self._held, self._past_limit = held, past_limit
        self._open = asyncio.Event()
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @contextmanager
    def closed(self) -> Iterator[None]:
        """Closed for the block (reopened however it ends)."""
        self.close()
        try:
            yield
        finally:
            self.open()

    async def wait(self) -> None:
        """Return at once when no cycle runs; else when it ends, or after max_wait_s."""
        if self._open.is_set():
            return
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self._open.wait(), self.max_wait_s)
        except TimeoutError:
            self._past_limit.inc()
        finally:
            self._held.inc(time.perf_counter() - started)
