"""Keeping a node agent on every host of a run: an agent that stopped posting batches and does not answer is
restarted through the launcher (healer/launchers/fleet.py): at once when its process has ended, after
`unreachable_after` when it may only be out of reach. The new one takes on the attempt's part on its host
(the ranks never noticed: they run in a session of their own and go on training). Nothing about the job changes:
no incident, no restart, no budget.

A host whose new agent cannot be started (the host is down, slurmd with it) is left to the host_lost detector,
which needs the job to have stopped with the host; the keeper tries again after `retry`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from healer.launchers.agent_client import AgentClient
from healer.launchers.coordinator import Coordinator
from healer.launchers.fleet import AgentFleet
from healer.observe.heartbeats import HeartbeatTable
from wire import journal
from wire.run_paths import RunPaths

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class KeeperConfig:
    silent_after: timedelta = timedelta(seconds=3)
    """An agent whose last batch is older than this is asked whether it still lives; one that does not answer and
    whose process is known to have ended is replaced at once."""
    unreachable_after: timedelta = timedelta(seconds=20)
    """An agent that does not answer while its process is not known to have ended (its host's link is down, or
    the host stalls) is replaced only after this long a silence. NOTE: replacing a live agent cancels its step, and
    under Slurm its ranks go with it: a link down for 4 s once cost a whole attempt (CI, 2026-12-01)."""
    retry: timedelta = timedelta(seconds=30)
    """After a failed restart, the next try on that host."""
    every: timedelta = timedelta(seconds=1)

    def __post_init__(self) -> None:
        if min(self.silent_after, self.retry, self.every) <= timedelta(0):
            raise ValueError("silent_after, retry and every must be > 0")
        if self.unreachable_after < self.silent_after:
            raise ValueError(f"unreachable_after must be >= silent_after, got {self.unreachable_after}")


class AgentKeeper:
    def __init__(self, fleet: AgentFleet, coordinator: Coordinator, table: HeartbeatTable,
                 hosts: Callable[[], list[str]], token: str, cfg: KeeperConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """`hosts`: the hosts that should have an agent now (the job's and its spares, not those left out)."""
        self.fleet, self.coordinator, self.table, self.hosts, self.token = fleet, coordinator, table, hosts, token
        self.cfg = cfg or KeeperConfig()
        self.clock = clock
        self.restarts: list[tuple[str, float, int | None]] = []
        """(host, when, the attempt its new agent took on) of every agent restarted."""
        self._since = clock()
        self._next_try: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaheal-agent-keeper", daemon=True)

    def start(self) -> None:
        self._since = self.clock()
        self._thread.start()

    def stop(self) -> None:
        """Before the agents are ended on purpose: none of them is brought back after this returns."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=120)

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.every.total_seconds()):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - NOTE: a failed look must not end the keeping
                log.warning("looking after the node agents failed", exc_info=True)

    def check(self) -> None:
        """One look: every host silent past `silent_after` whose agent does not answer gets a new one."""
        now = self.clock()
        heard = {n.node: n.received_at for n in self.table.nodes()}
        for node in self.hosts():
            if self._stop.is_set():
                return
            last = max(heard.get(node, self._since), self._since)
            silent = now - last
            if silent <= self.cfg.silent_after.total_seconds() or now < self._next_try.get(node, 0.0):
                continue
            if self._answers(node):
                continue  # alive, only its batches are late (a slow healer endpoint, a busy host)
            if silent <= self.cfg.unreachable_after.total_seconds() and not self.fleet.gone(node):
                continue  # out of reach, not known dead: a short cut is ridden out
            self._replace(node, now)

    def _answers(self, node: str) -> bool:
        client = self.coordinator.agents.get(node)
        return client is not None and client.answers(timeout_s=2.0)

    def _replace(self, node: str, now: float) -> None:
        log.warning("the agent of %s is silent and does not answer: starting a new one", node)
        try:
            url = self.fleet.restart(node)
        except Exception as exc:  # noqa: BLE001 - NOTE: the host may be down; host_lost decides about the job
            self._next_try[node] = now + self.cfg.retry.total_seconds()
            log.warning("a new agent on %s could not be started (%s); next try in %.0f s", node, exc,
                        self.cfg.retry.total_seconds())
            return
        old = self.coordinator.agents.get(node)
        tls = old.tls if old is not None else self.fleet.healer_tls()  # the healer's own certificate, as before
        adopted = self.coordinator.reattach(node, AgentClient(node, url, self.token, tls=tls))
        self.restarts.append((node, now, adopted))
        journal.append(RunPaths(Path(self.coordinator.cfg.run_dir)).journal,
                       journal.AgentRestarted(node=node, at=now, url=url, adopted=adopted))
