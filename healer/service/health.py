"""Readiness: whether the database is reachable and at the newest revision, checked on a schedule.

The probe fails closed: any failure (unreachable, wrong revision, something unexpected) makes the healer
not ready, with the reason in /readyz, and the ticks that need the database skip their turn instead of
failing every second. A database that comes back (or an empty one that appears) is picked up by the next
probe; the healer never exits over it, so a supervisor does not restart it in a loop.

A database that hangs (a frozen server, a full disk, a lock held forever) is a failure too: the check runs on
one thread of its own and the probe waits for it at most `timeout`. A check still hanging from an earlier probe
is not joined by another one, so a hung database holds one thread, not one per probe.

Why the reason is for authenticated callers only: it names the database host and user and carries the driver's
own error text; unauthenticated callers (load balancers, compose's health check) get ready or not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

UNAVAILABLE = "unavailable (the reason is shown to authenticated callers and logged)"


class Readiness:
    def __init__(self, check: Callable[[], str], timeout: timedelta = timedelta(seconds=10)) -> None:
        """`check` returns the schema revision or raises with a message saying what is wrong; `timeout` is how
        long a probe waits for it."""
        self._check = check
        self._timeout = timeout.total_seconds()
        self._lock = threading.Lock()
        self._pending: threading.Thread | None = None
        self.ready = False
        self.reason = "not checked yet"
        self.revision: str | None = None
        self.on_ready: list[Callable[[], None]] = []

    def probe(self) -> bool:
        try:
            revision = self._run_check()
        except Exception as exc:  # noqa: BLE001 - a health probe fails closed, whatever went wrong
            self._set(False, str(exc).splitlines()[0] if str(exc) else type(exc).__name__, None, exc)
            return False
        became_ready = not self.ready
        self._set(True, "ok", revision, None)
        if became_ready:
            for callback in self.on_ready:
                callback()
        return True

    def _run_check(self) -> str:
        # NOTE: a daemon thread per check, not an executor: an executor's workers are joined at exit, and a
        # check hanging on a frozen database would then hold the healer's shutdown too.
        with self._lock:
            if self._pending is not None and self._pending.is_alive():
                raise TimeoutError(f"the database has not answered the readiness check for more than "
                                   f"{self._timeout:g}s (hung or unreachable)")
            outcome: dict[str, Any] = {}
            self._pending = thread = threading.Thread(target=self._run_into, args=(outcome,), daemon=True,
                                                      name="megaheal-readiness")
            thread.start()
        thread.join(self._timeout)
        if thread.is_alive():
            raise TimeoutError(f"the database did not answer the readiness check within {self._timeout:g}s "
                               "(hung or unreachable)")
        if "error" in outcome:
            raise outcome["error"]
        return str(outcome["revision"])

    def _run_into(self, outcome: dict[str, Any]) -> None:
        try:
            outcome["revision"] = self._check()
        except Exception as exc:  # noqa: BLE001 - handed to the probe, which fails closed
            outcome["error"] = exc

    def _set(self, ready: bool, reason: str, revision: str | None, exc: BaseException | None) -> None:
        with self._lock:
            changed = ready != self.ready or reason != self.reason
            self.ready, self.reason, self.revision = ready, reason, revision
        if changed and not ready:
            log.error("not ready: %s", reason, exc_info=exc)
        elif changed:
            log.info("ready: database at revision %s", revision)

    def report(self, detail: bool = False) -> dict[str, Any]:
        """/readyz's body: ready or not; with `detail` (an authenticated caller) the reason and the revision."""
        with self._lock:
            if detail:
                return {"ready": self.ready, "database": self.reason, "revision": self.revision}
            return {"ready": self.ready, "database": "ok" if self.ready else UNAVAILABLE}
