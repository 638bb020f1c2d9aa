"""The coordinator's take-over part: a healer that takes a run over from one that died adopts its last attempt where it
still runs on a majority of its hosts (healer/launchers/takeover_vote.py; a host that misses a state check is asked
again first), else stops what is left of it (killing here, checked, what a host without an agent left); and a host
whose agent was replaced takes on its part of the running attempt."""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import replace

from ground import kill
from healer.launchers.agent_client import AgentClient, AgentUnreachable, OrderFailed
from healer.launchers.attempt import AgentAttempt
from healer.launchers.coordinator_base import CoordinatorBase, on_each
from healer.launchers.journal import targets as journal_targets
from healer.launchers.takeover_vote import HostSays, TakeOverVote, vote
from wire import journal
from wire.orders import AdoptOrder, StopOrder
from wire.run_ids import pool_run_id, run_id

log = logging.getLogger(__name__)


class TakeOvers(CoordinatorBase):
    ASK_AGAIN_S: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    """The waits before each state check asked again of the hosts not reached, while they could tip the vote (15 s in
    all: an agent busy for a moment, a host's network back after a blip, must not stop the whole job)."""

    def take_over(self, token: str) -> tuple[bool, tuple[int, ...]]:
        """After the job's previous healer died (its agents outlived it): adopt its last attempt where it still runs on
        a majority of its hosts (the job goes on, nothing restarts; the others are left to the detectors), else stop
        what is left of it (the job then resumes from its newest good checkpoint). Numbers the next attempt after it.
        Whether the attempt was adopted, and the pids killed here (of hosts whose agent was gone, when they are this
        machine's)."""
        self._check(token)
        self.fence.check()
        past = journal.Journal.of(self._paths.journal)
        last = past.last_attempt()
        if last is None:
            return False, ()
        self._first_number = last + 1
        mine = past.of_attempt(last)
        start = next((e for e in mine if isinstance(e, journal.Start)), None)
        if start is None or any(isinstance(e, journal.End) for e in mine):
            return False, ()
        nodes = tuple(start.nodes)
        # NOTE: a warm generation cannot be adopted: its pool's store lived in the healer that died, so no next
        # generation could be planned for it. It is stopped, and the job resumes cold.
        warm = start.warm
        if warm is None and (ballot := self._vote(last, nodes)).adopt:
            with self._lock:
                self.attempt = AgentAttempt(number=last, nodes=nodes, started_at=start.at, dp=start.dp,
                                            resume=start.resume)
                self.history = [self.attempt]
                self.view.started(self.cfg.job, last, nodes, self.clock())
            log.warning("took over %s: %s", self.cfg.job, ballot.decision_basis)
            for node in ballot.not_running:
                self._adopt_part(node)
            return True, ()
        unreached = []
        for node in nodes:
            try:
                if node not in self.agents:
                    raise AgentUnreachable(f"no agent for {node}")
                result = self._client(node).run(StopOrder(id=self._order_id("stop", last, node, ":take-over"),
                                                          epoch=self.epoch, attempt=last, grace_s=0.5), 60)
                if result.stopped != last:
                    # A new agent on that host (the old one died): it never ran the attempt, and cannot stop it.
                    raise AgentUnreachable(f"the agent of {node} does not know attempt {last}")
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("take-over: stopping attempt %d on %s: %s", last, node, exc)
                unreached.append(node)
        killed: list[int] = []
        if unreached and self.cfg.hosts_are_local:
            # NOTE: an agent that died with the healer leaves its torchrun and ranks running (their own session):
            # the journal names them, and each is killed only if it is still that process of that attempt.
            # The workers of a warm pool carry the run id of the attempt that formed it.
            rid = pool_run_id(self.cfg.job, warm.formed_in) if warm is not None and warm.formed_in is not None \
                else run_id(self.cfg.job, last)
            targets = journal_targets(mine, rid)
            for t in targets:
                kill.send(t, signal.SIGKILL)
            kill.wait_gone(targets, timeout_s=30)
            killed = [t.pid for t in targets]
        self._journal(journal.End(attempt=last, at=self.clock(), stopped=True, taken_over=True, killed=killed,
                                  lost=unreached))
        log.warning("took over %s: attempt %d was left by the previous healer; stopped (%d process(es) of hosts "
                    "without an agent killed)", self.cfg.job, last, len(killed))
        return False, tuple(killed)

    def _vote(self, attempt: int, nodes: tuple[str, ...]) -> TakeOverVote:
        """Ask every host whether it runs `attempt` (all at once), and the unreached again while they could tip the
        vote (ASK_AGAIN_S); the vote."""
        says: dict[str, HostSays] = {}

        def ask(node: str) -> None:
            says[node] = self._host_says(node, attempt)

        pending = list(nodes)
        for wait in (0.0, *self.ASK_AGAIN_S):
            time.sleep(wait)
            on_each(pending, ask)
            ballot = vote(attempt, nodes, says, final=False)
            if ballot.adopt is not None:
                return ballot
            pending = list(ballot.unreached)
            log.warning("take-over of %s: %s", self.cfg.job, ballot.decision_basis)
        return vote(attempt, nodes, says, final=True)

    def _host_says(self, node: str, attempt: int) -> HostSays:
        if node not in self.agents:
            return HostSays.NOT_RUNNING  # NOTE: no agent to ask, now or later: what it left is stopped, or killed here
        try:
            # NOTE: one try per round (2 s at most): the rounds are the retries, 25 s at most in all.
            report = replace(self._quick(node), attempts=1).state()["attempt"]
        except (AgentUnreachable, OrderFailed) as exc:
            log.warning("take-over: the agent of %s did not say what runs there: %s", node, exc)
            return HostSays.UNREACHED
        if report is None or report["attempt"] != attempt or report["ended"] or report["stopping"]:
            return HostSays.NOT_RUNNING
        return HostSays.RUNS

    def _adopt_part(self, node: str) -> None:
        """A host of the adopted attempt whose agent does not run it: a new agent (the old one died) may find its
        ranks still running and take them on; else the host is left to the detectors."""
        if node in self.agents and self.reattach(node, self.agents[node]) is None:
            log.warning("took over %s: attempt %d does not run on %s (left to the detectors)", self.cfg.job,
                        self.attempt.number if self.attempt else -1, node)

    def reattach(self, node: str, client: AgentClient) -> int | None:
        """`node` has a new agent (`client`; its old one died): orders go to it from now on, and it takes on the
        current attempt's part there if that still runs (AdoptOrder). The attempt it adopted, or None."""
        with self._lock:
            self.agents[node] = client
            a = self.attempt
            if a is None or node not in a.nodes or node in a.ended or a.stopping or self.fence.by is not None:
                return None
            number, node_rank = a.number, a.nodes.index(node)
        try:
            replace(client, fence=self.fence).run(
                AdoptOrder(id=self._order_id("adopt", number, node, f":{time.time_ns()}"), epoch=self.epoch,
                           job=self.cfg.job, attempt=number, node_rank=node_rank), 30)
        except OrderFailed as exc:
            log.warning("the new agent of %s did not find attempt %d running there: %s", node, number, exc)
            return None
        self._journal(journal.Adopted(attempt=number, node=node, at=self.clock()))
        log.warning("the new agent of %s took on attempt %d", node, number)
        return number
