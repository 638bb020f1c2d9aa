"""The coordinator's warm part: an attempt formed as a new warm pool (its workers outlive it), and the next attempt made
from the running one without stopping it (a warm restart: survivors keep their processes and state, a standby takes
each rank that is gone)."""

from __future__ import annotations

import logging
from datetime import timedelta

import msgspec

from healer.launchers.agent_client import AgentUnreachable, OrderFailed
from healer.launchers.attempt import AgentAttempt
from healer.launchers.coordinator_base import START_TIMEOUT_S, CoordinatorBase, on_each
from healer.launchers.warm_control import Generation, WarmUnavailable
from wire import journal
from wire.orders import SignalOrder, Worker, WorkersOrder

log = logging.getLogger(__name__)


class WarmGenerations(CoordinatorBase):
    def _form_warm(self, token: str, number: int, nodes: tuple[str, ...], resume: str | None,
                   overrides: tuple[str, ...], spares: tuple[str, ...] = ()) -> AgentAttempt:
        """Attempt `number` as a new warm pool: every host starts its workers (a spare its standbys), and once all
        of the ranks are up the generation's plan starts them (from the disk, as `resume` says)."""
        assert self.warm is not None and self.attempt is not None
        gen = self.warm.form(number, nodes, "formation")
        self.attempt.warm, self.attempt.standby_hosts = gen, spares
        try:
            self._order_warm(number, gen, resume, overrides, spares)
            self.warm.wait_up(list(gen.assign))
        except (AgentUnreachable, OrderFailed, RuntimeError) as exc:
            log.error("attempt %d of %s could not start: %s", number, self.cfg.job, exc)
            self.stop(token, timedelta(0))
            raise RuntimeError(f"attempt {number} could not start: {exc}") from exc
        self.warm.publish(gen, overrides=overrides, disk_resume=resume)
        log.info("attempt %d of %s started warm-capable on %s (a new pool; resume %s)", number, self.cfg.job,
                 ", ".join(nodes), resume)
        return self.attempt

    def _order_warm(self, number: int, gen: Generation, resume: str | None, overrides: tuple[str, ...],
                    spares: tuple[str, ...] = ()) -> None:
        """Each host's start order of a warm generation, all at once; the first failure of a host of the generation
        is raised (a spare that does not take its standbys only cannot take a host's place later: it is logged)."""
        assert self.warm is not None
        parts = self.warm.start_orders(gen, spares)
        hosts = (*gen.nodes, *spares)
        failures: list[Exception] = []

        def order(node_rank: int) -> None:
            node = hosts[node_rank]
            order = msgspec.structs.replace(self.start_order(number, hosts, node_rank, None, resume, overrides),
                                            warm=parts[node])
            try:
                self._client(node).run(order, START_TIMEOUT_S)
            except (AgentUnreachable, OrderFailed) as exc:
                if node in gen.nodes:
                    failures.append(exc)
                else:
                    log.warning("spare %s did not take its standbys: %s", node, exc)

        on_each(list(range(len(hosts))), order)
        if failures:
            raise failures[0]

    def restart_warm(self, token: str, nodes: tuple[str, ...], dp: int | None, extra: tuple[str, ...] = (),
                     at_most_step: int | None = None, why: str = "", spares: tuple[str, ...] = (),
                     replace_ranks: tuple[int, ...] = ()) -> AgentAttempt:
        """The next attempt from the running one without stopping it: its live ranks keep their processes and
        state, a standby takes each rank that is gone, and all resume from the newest snapshot they hold in memory
        (at or before `at_most_step`: a rollback). A host of the running attempt that is not in `nodes` leaves: the
        spare in its place takes its ranks with its standbys (what still runs on the host that left is stopped
        there as a leftover, once it reports). `replace_ranks`: live ranks that are killed first and replaced (a
        hang's). WarmUnavailable, with nothing changed but those kills, when it cannot be made (no warm pool, no
        standby for a lost rank, a host that does not answer, another layout)."""
        self._check(token)
        self.fence.check()
        if self.warm is None:
            raise WarmUnavailable("the job does not run warm")
        with self._lock:
            if self.closed:
                raise RuntimeError(f"the coordinator of {self.cfg.job} is shutting down: no new attempt")
            old = self.attempt
            if old is None or old.warm is None or old.stopping:
                raise WarmUnavailable("the current attempt is not a warm generation that runs")
            number = old.number + 1
        workers: dict[str, list[Worker]] = {}
        if replace_ranks:
            self.view.replacing(self.cfg.job, old.number, replace_ranks)
            self._kill_ranks(old, replace_ranks)

        def ask(node: str) -> None:
            try:
                answer = self._quick(node).run(WorkersOrder(id=self._order_id("workers", number, node),
                                                            epoch=self.epoch), 5)
                workers[node] = answer.workers
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("warm restart: the workers of %s: %s", node, exc)

        on_each(list(nodes), ask)
        gen = self.warm.replace(number, nodes, workers, why, frozenset(replace_ranks))
        try:
            self.warm.wait_up(list(gen.replaced.values()), self.warm.settings.standby_wait_s)
        except RuntimeError as exc:
            raise WarmUnavailable(str(exc)) from exc
        overrides = self.overrides(dp, extra)
        # NOTE: the plan first: every survivor leaves the old generation as soon as it reads it (a collective with the
        # dead rank would hold it up to the collective timeout), while the agents are told below.
        self.warm.publish(gen, overrides=overrides, disk_resume="auto", at_most_step=at_most_step)
        now = self.clock()
        with self._lock:
            old.supersede()
            self.attempt = AgentAttempt(number=number, nodes=tuple(nodes), started_at=now, dp=dp, resume="memory",
                                        warm=gen, standby_hosts=spares)
            self.history.append(self.attempt)
            self._journal(journal.End(attempt=old.number, at=now, stopped=False, superseded=True))
            self._journal(journal.Start(job=self.cfg.job, attempt=number, at=now, nodes=list(nodes), dp=dp,
                                        resume="memory", agent_urls={n: self.agents[n].url for n in nodes},
                                        warm=journal.WarmNote(replaced=gen.replaced, why=why,
                                                              formed_in=self.warm.formed_in)))
        try:
            self._order_warm(number, gen, "auto", overrides, spares)
        except (AgentUnreachable, OrderFailed) as exc:
            # The generation was planned: a host that did not take its order is lost to it (a crash incident follows,
            # and the restart after it is cold).
            log.error("warm restart %d of %s: a host did not take its order: %s", number, self.cfg.job, exc)
        # NOTE: after the agents took their orders: a report of the old attempt that comes after this is a leftover
        # to stop, and a stop of the old attempt must find the new one there (then it does nothing).
        self.view.started(self.cfg.job, number, tuple(nodes), now)
        log.warning("attempt %d of %s: warm restart (%s; ranks replaced: %s)", number, self.cfg.job, why,
                    {r: w for r, w in gen.replaced.items()} or "none")
        return self.attempt

    def _kill_ranks(self, attempt: AgentAttempt, ranks: tuple[int, ...]) -> None:
        """SIGKILL the processes of `ranks` in `attempt` through their hosts' agents (a hung rank cannot be trusted
        to leave its generation); one that cannot be signalled is logged: its worker is replaced all the same, and
        a frozen one dies once it thaws."""
        node_of = {w_rank: attempt.warm.node_of[w] for w, w_rank in attempt.warm.assign.items()} \
            if attempt.warm is not None else {}

        def kill(rank: int) -> None:
            node = node_of.get(rank)
            if node is None:
                return
            try:
                self._quick(node).run(SignalOrder(id=self._order_id("kill", attempt.number, node, f":{rank}"),
                                                  epoch=self.epoch, attempt=attempt.number, rank=rank,
                                                  signal="SIGKILL"), 5)
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("warm restart: rank %d on %s could not be killed: %s", rank, node, exc)

        on_each(sorted(ranks), kill)

    def warm_ready(self, attempt: AgentAttempt, resumed: dict[str, str]) -> None:
        """Journal where each rank of a warm generation took its state from, and how long its group and state took
        (the workers' own words: "memory step 12 in 0.310 s"; bench/recovery.py reads them)."""
        self._journal(journal.WarmReady(attempt=attempt.number, at=self.clock(), resumed=resumed))
