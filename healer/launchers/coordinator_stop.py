"""The coordinator's stopping part: every host stops its part of the attempt (SIGTERM, SIGKILL after the grace, at once
when hurried), a host that cannot be reached counts as lost, and an older attempt found still running on a host that
came back is stopped there."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from healer.launchers.agent_client import AgentUnreachable, OrderFailed
from healer.launchers.attempt import AgentAttempt
from healer.launchers.coordinator_base import CoordinatorBase, on_each
from wire import journal
from wire.orders import StopOrder

log = logging.getLogger(__name__)

STANDBYS_STOP_S = 30.0
"""How long a spare's agent has to stop its standbys (SIGKILL, no grace: they train nothing)."""


class Stops(CoordinatorBase):
    def close(self) -> None:
        """No attempt starts from now on (`megaheal run` is on its way out): a restart ordered before cannot start
        one after the job was stopped."""
        with self._lock:
            self.closed = True

    def stop(self, token: str, grace: timedelta | None = None, hurry: Callable[[], bool] = lambda: False) -> None:
        """Every host stops its part (SIGTERM, SIGKILL after `grace`, or at once when `hurry()` turns true: a second
        Ctrl-C); returns once all reported it ended, or its agent could not be reached (a lost host: nothing of the
        attempt can run there with its peers gone)."""
        self._check(token)
        if self.fence.by is not None:
            # NOTE: the newer healer decides about the job now: a stop from here would only be refused, host by host.
            log.warning("fenced: %s is not stopped from here (a newer healer drives it)", self.cfg.job)
            return
        with self._lock:
            a = self.attempt
            if a is None:
                return
            self.view.stopping(self.cfg.job)
            a.stop()
        grace_s = (self.cfg.grace if grace is None else grace).total_seconds()

        def order_stop(node: str) -> None:
            try:
                self._quick(node).order(StopOrder(id=self._order_id("stop", a.number, node), epoch=self.epoch,
                                                  attempt=a.number, grace_s=grace_s))
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("stopping attempt %d on %s: %s; the host counts as lost", a.number, node, exc)
                with self._lock:
                    if a.hosts_lost({node}):
                        self._journal(journal.End(attempt=a.number, at=self.clock(), exit_codes=dict(a.exit_codes),
                                                  stopped=True, lost=sorted(a.lost)))

        on_each([n for n in a.nodes if n not in a.ended], order_stop)
        deadline = time.monotonic() + grace_s + 30
        hurried = grace_s == 0
        while not a.done and time.monotonic() < deadline:
            if not hurried and hurry():
                hurried = True
                self._hurry(a)
            time.sleep(0.05)
            self.poll()
        if not a.done:
            missing = sorted(set(a.nodes) - a.ended)
            log.warning("attempt %d: no end reported by %s after the stop; counted as lost", a.number, missing)
            with self._lock:
                a.hosts_lost(set(missing))
            self._journal(journal.End(attempt=a.number, at=self.clock(), exit_codes=dict(a.exit_codes), stopped=True,
                                      lost=missing))
        self._stop_standbys(a)
        if self.warm is not None:
            self.warm.forget()  # every host stopped its whole pool: the next attempt forms a new one

    def _stop_standbys(self, a: AgentAttempt) -> None:
        """The attempt's standbys on its spares, stopped at once (they hold no rank; a spare's replicas are of a pool
        that ends here). A spare that does not answer is logged: what runs there is stopped as a leftover once it
        reports, and a start order it is given meanwhile is refused."""
        def order_stop(node: str) -> None:
            try:
                self._client(node).run(StopOrder(id=self._order_id("stop", a.number, node, ":standbys"),
                                                 epoch=self.epoch, attempt=a.number, grace_s=0), STANDBYS_STOP_S)
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("stopping the standbys of attempt %d on %s: %s", a.number, node, exc)

        on_each([n for n in a.standby_hosts if n not in a.nodes], order_stop)

    def _hurry(self, a: AgentAttempt) -> None:
        """A stop with no grace to every host still stopping: it cuts short the stop in progress there."""
        def order(node: str) -> None:
            try:
                self._quick(node).order(StopOrder(id=self._order_id("stop", a.number, node, ":now"), epoch=self.epoch,
                                                  attempt=a.number, grace_s=0))
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("hurrying the stop of attempt %d on %s: %s", a.number, node, exc)

        on_each(sorted(set(a.nodes) - a.ended), order)

    def _stop_leftover(self, node: str, attempt: int) -> None:
        """An older attempt still runs on `node` (its agent was cut off when the healer stopped that attempt, and is
        back; or a warm restart left the host out while its workers ran): stop it there, off the caller's thread."""
        if node not in self.agents or self.fence.by is not None:
            return
        client = self._client(node)
        with self._lock:
            # NOTE: the agent goes on reporting the attempt until the stop is done: one stop (and one journal line) per
            # leftover, not one per report (two came 0.16 s apart on a loaded machine).
            if (node, attempt) in self._leftovers_stopping:
                return
            self._leftovers_stopping.add((node, attempt))

        def stop() -> None:
            try:
                client.run(StopOrder(id=self._order_id("stop", attempt, node, ":leftover"), epoch=self.epoch,
                                     attempt=attempt, grace_s=0), 60)
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("attempt %d still runs on %s and could not be stopped: %s", attempt, node, exc)
                with self._lock:
                    self._leftovers_stopping.discard((node, attempt))  # the next report of it tries again
                return
            self._journal(journal.LeftoverStopped(attempt=attempt, node=node, at=self.clock()))
            log.warning("attempt %d was still running on %s (left out, or cut off when it was stopped): stopped now",
                        attempt, node)

        threading.Thread(target=stop, name=f"megaheal-leftover-{node}", daemon=True).start()
