"""Readiness: whether the database is reachable and at the newest revision, checked on a schedule.

The probe fails closed: any failure (unreachable, wrong revision, something unexpected) makes the healer
not ready, with the reason in /readyz, and the ticks that need the database skip their turn instead of
failing every second. A database that comes back (or an empty one that appears) is picked up by the next
probe; the healer never exits over it, so a supervisor does not restart it in a loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Readiness:
    def __init__(self, check: Callable[[], str]) -> None:
        """`check` returns the schema revision or raises with a message saying what is wrong."""
        self._check = check
        self._lock = threading.Lock()
        self.ready = False
        self.reason = "not checked yet"
        self.revision: str | None = None
        self.on_ready: list[Callable[[], None]] = []

    def probe(self) -> bool:
        try:
            revision = self._check()
        except Exception as exc:  # noqa: BLE001 - a health probe fails closed, whatever went wrong
            self._set(False, str(exc).splitlines()[0] if str(exc) else type(exc).__name__, None, exc)
            return False
        became_ready = not self.ready
        self._set(True, "ok", revision, None)
        if became_ready:
            for callback in self.on_ready:
                callback()
        return True

    def _set(self, ready: bool, reason: str, revision: str | None, exc: BaseException | None) -> None:
        with self._lock:
            changed = ready != self.ready or reason != self.reason
            self.ready, self.reason, self.revision = ready, reason, revision
        if changed and not ready:
            log.error("not ready: %s", reason, exc_info=exc)
        elif changed:
            log.info("ready: database at revision %s", revision)

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {"ready": self.ready, "database": self.reason, "revision": self.revision}
