"""The coordinator's part for a job that trains as replica groups, one per host (train/ft/): each host's torchrun is a
world of its own (`nnodes` 1), told its group's index and the Lighthouse the groups meet at, and a host's group is
replaced within the attempt while every other group trains on:

    start          every host its own group, 0 .. n-1, all at once
    regroup        the groups of the hosts that leave are stopped (a lost host's is gone already), and a group is
                   started on each host that joins, taking a leaving one's index, and again on each host whose group
                   ended; the attempt's other hosts are not touched

The attempt keeps its number: its ranks never stopped, and their records and heartbeats stay the attempt's.
"""

from __future__ import annotations

import logging
import threading
import time

from healer.launchers.agent_client import AgentUnreachable, OrderFailed
from healer.launchers.attempt import AgentAttempt
from healer.launchers.coordinator_base import START_TIMEOUT_S, CoordinatorBase, GroupSettings, on_each
from wire import journal
from wire.orders import ReplicaStart, StartOrder, StopOrder

log = logging.getLogger(__name__)


__all__ = ["GroupSettings", "Groups", "NothingToJoin"]
GROUP_END_WAIT_S = 30.0
"""The longest a broken group's stop (and its agent's word that it ended) is waited for before one starts again."""


class NothingToJoin(RuntimeError):
    """No group of the attempt trains (it ended, or is being stopped): a group started now would have no peer."""


class Groups(CoordinatorBase):
    group_of: dict[str, int]
    """Host -> the index of the replica group it runs (the current attempt's)."""
    _group_overrides: tuple[str, ...]
    """The current attempt's `--set` items: a group started within it gets the same."""
    _regroups: int
    """Regroups of the current attempt so far."""

    def group_order(self, order: StartOrder, node: str, at_least: int = 0) -> StartOrder:
        """`order` as the start of `node`'s replica group: a world of one host, its group's index, the Lighthouse."""
        assert self.cfg.groups is not None
        return StartOrder(**{f: getattr(order, f) for f in order.__struct_fields__ if f not in
                             ("id", "nnodes", "node_rank", "rdzv_endpoint", "replica")},
                          # NOTE: a group started again on a host within the attempt is another start: its own id
                          id=self._order_id("start", order.attempt, node, f":regroup-{self._regroups}"),
                          nnodes=1, node_rank=0, rdzv_endpoint=None,
                          replica=ReplicaStart(group=self.group_of[node], lighthouse=self.cfg.groups.lighthouse,
                                               at_least=at_least))

    def _start_groups(self, number: int, nodes: tuple[str, ...], resume: str | None,
                      overrides: tuple[str, ...]) -> list[Exception]:
        """Every host's group of attempt `number`, at once; the failures."""
        self.group_of = {node: i for i, node in enumerate(nodes)}
        self._group_overrides, self._regroups = overrides, 0
        self.view.train_in_groups(self.cfg.job)
        return self._launch_groups(number, list(nodes), resume, overrides)

    def _launch_groups(self, number: int, nodes: list[str], resume: str | None,
                       overrides: tuple[str, ...], at_least: int = 0) -> list[Exception]:
        failures: list[Exception] = []

        def launch(node: str) -> None:
            order = self.group_order(self.start_order(number, (node,), 0, None, resume, overrides), node, at_least)
            try:
                result = self._client(node).run(order, START_TIMEOUT_S)
            except (AgentUnreachable, OrderFailed) as exc:
                failures.append(exc)
                return
            self._journal(journal.Launched(attempt=number, at=self.clock(), agents={node: result.pid},
                                           agents_started={node: result.started}))

        on_each(nodes, launch)
        return failures

    def regroup(self, token: str, nodes: tuple[str, ...], why: str = "", at_least: int = 0) -> tuple[list[str], list[str]]:
        """The current attempt goes on on `nodes`: the groups of its hosts not in `nodes` are stopped (SIGKILL: a
        lost host's agent does not answer, and a group that leaves has nothing to save: its peers hold the same
        state), and a group is started on every host of `nodes` that joins, or whose group ended or lost a rank
        (what is left of it is stopped first); (left, started). NothingToJoin when no group of the attempt trains;
        RuntimeError when a start fails."""
        self._check(token)
        self.fence.check()
        with self._lock:
            a = self.attempt
            failed = self._failed_hosts(a) if a is not None else set()
            if a is None or a.done or a.stopping or \
                    not [n for n in nodes if n in a.nodes and n not in a.ended and n not in failed]:
                raise NothingToJoin("no group of the attempt trains: a group started now has no peer to join")
            left = [n for n in a.nodes if n not in nodes]
            joining = [n for n in nodes if n not in a.nodes]
            again = [n for n in nodes if n in a.nodes and (n in a.ended or n in failed)]
            free = sorted(self.group_of[n] for n in left)
            taken = {self.group_of[n] for n in nodes if n in a.nodes}
            for node in joining:
                self.group_of[node] = free.pop(0) if free else min(set(range(len(taken) + len(joining) + 1)) - taken)
                taken.add(self.group_of[node])
            for node in left:
                del self.group_of[node]
        on_each(left, lambda node: self._stop_group(a, node))
        on_each(again, lambda node: self._end_group(a, node))
        with self._lock:
            started = [*joining, *again]
            self._regroups += 1
            _regrouped(a, tuple(nodes), left, again)
            self.view.regrouped(self.cfg.job, tuple(nodes), (*left, *again))
        # NOTE: from nothing (resume none): the group takes a live peer's state at its first quorum; its own
        # checkpoints on the disk are older than that, and reading them would only add to its time to join
        failures = self._launch_groups(a.number, started, "none", self._group_overrides, at_least)
        self._journal(journal.Regrouped(attempt=a.number, at=self.clock(), nodes=list(nodes), left=left,
                                        started=started, groups={n: self.group_of[n] for n in nodes}, why=why[:2000]))
        if failures:
            raise RuntimeError(f"replica group(s) could not start: {failures[0]}")
        log.warning("attempt %d of %s goes on on %s: group(s) of %s left, started on %s", a.number, self.cfg.job,
                    ", ".join(nodes), ", ".join(left) or "none", ", ".join(started) or "none")
        return left, started

    def finish_groups(self, a: AgentAttempt) -> None:
        """Called with the lock held, as hosts' parts end: once a group ended 0, it trained the last step (the
        groups commit the same steps), and the job is done; a group still on its way in has nothing left to train
        and would wait for a quorum that never comes. Its part counts as finished, and is stopped."""
        if self.cfg.groups is None or a.done or a.stopping or not any(c == 0 for c in a.exit_codes.values()):
            return
        late = [n for n in a.nodes if n not in a.ended]
        if not late:
            return
        log.warning("attempt %d of %s: a group trained the last step; the group(s) of %s, still joining, are stopped",
                    a.number, self.cfg.job, ", ".join(late))
        for node in late:
            if a.host_ended(node, 0):
                self._journal(journal.End(attempt=a.number, at=self.clock(), exit_codes=dict(a.exit_codes),
                                          stopped=False))
        threading.Thread(target=on_each, args=(late, lambda node: self._stop_group(a, node)), daemon=True,
                         name="megaheal-late-groups").start()

    def _failed_hosts(self, a: AgentAttempt) -> set[str]:
        """The hosts of the attempt where a rank ended with a failure (the group there is broken: its torchrun stops
        the rest of it, or has)."""
        return {e.node for e in self.view.exits() if e.job == self.cfg.job and e.attempt == a.number and e.failed
                and e.node in a.nodes}

    def _stop_group(self, a: AgentAttempt, node: str) -> None:
        try:
            self._quick(node).order(StopOrder(id=self._order_id("stop", a.number, node, ":group"), epoch=self.epoch,
                                              attempt=a.number, grace_s=0))
        except (AgentUnreachable, OrderFailed) as exc:
            log.warning("stopping the group of attempt %d on %s: %s (lost: nothing of it runs with its peers)",
                        a.number, node, exc)

    def _end_group(self, a: AgentAttempt, node: str) -> None:
        """What is left of a broken group on `node` stopped, and its end heard by the view, before one is started
        there again: a late report of the old part's end must not be taken for the new one's."""
        try:
            self._client(node).run(StopOrder(id=self._order_id("stop", a.number, node, ":again"), epoch=self.epoch,
                                             attempt=a.number, grace_s=0), GROUP_END_WAIT_S)
        except (AgentUnreachable, OrderFailed) as exc:
            log.warning("ending the group of attempt %d on %s: %s", a.number, node, exc)
            return
        deadline = time.monotonic() + GROUP_END_WAIT_S
        while node not in self.view.ended_nodes(self.cfg.job) and time.monotonic() < deadline:
            time.sleep(0.05)


def _regrouped(a: AgentAttempt, nodes: tuple[str, ...], left: list[str], again: list[str]) -> None:
    """The attempt's record of its hosts after a regroup: the hosts that left are no longer its, and the parts
    started again have not ended."""
    a.nodes = nodes
    for node in (*left, *again):
        a.ended.discard(node)
        a.exit_codes.pop(node, None)
        a.lost.discard(node)
