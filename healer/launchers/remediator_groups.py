"""The remediator's part for a job of replica groups (train/ft/; healer/launchers/coordinator_groups.py): a restart
in the `replica` mode, and when the groups it started have trained. Mixed into AgentRemediator.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from healer.launchers import rank_records
from healer.launchers.coordinator_groups import NothingToJoin
from healer.ports import RestartOrder, Started

if TYPE_CHECKING:
    from healer.launchers.remediator import AgentRemediator


class GroupRestarts:
    def _regroup(self: AgentRemediator, order: RestartOrder) -> Started:
        """The running attempt goes on on the order's hosts (Coordinator.regroup): the groups of the hosts that leave
        are stopped, a spare's group joins in a leaving one's place, a group that ended starts again; every other
        group trains on. The step the others were at is where the joining groups resume, from a live peer."""
        ordered = time.monotonic()
        placement, left_out = self.placement.moved_to(order.nodes, order.dp, order.released)
        doubts = self.drainer.witness(order.incident_id) if left_out and self.drainer is not None else None
        try:
            # NOTE: the groups started join only a quorum that reached the job's step: two of them at once must not
            # train on from step 0 by themselves while the others are busy (a fresh make test's bed run did)
            reached = self.highest_step(self.sup.attempt.number) if self.sup.attempt is not None else None
            left, started = self.sup.regroup(self.token, placement.nodes, why=order.mode_why,
                                             at_least=reached + 1 if reached is not None else 0)
        except NothingToJoin:
            if doubts is not None:
                doubts.cancel()
            raise
        self.placement = placement
        attempt = self.sup.attempt
        assert attempt is not None
        if left_out and self.drainer is not None:
            threading.Thread(target=self._drain_left_out, args=(order.incident_id, left_out, doubts), daemon=True,
                             name="megaheal-drain").start()
        at = self.highest_step(attempt.number)
        return Started(attempt=attempt.number, at=datetime.now(UTC), from_step=at + 1 if at is not None else None,
                       resume="a live peer group's state", nodes=self.nodes, dp=self.dp, mode="replica",
                       mode_why=order.mode_why + (f"; left: {', '.join(left)}" if left else "")
                       + (f"; started: {', '.join(started)}" if started else ""),
                       stages={"regroup_s": round(time.monotonic() - ordered, 3)})

    def groups_trained(self: AgentRemediator, nodes: tuple[str, ...], since: float) -> int | None:
        """Once every host of `nodes` recorded a step since `since` (a regroup's new groups joined and trained), the
        lowest of their first steps; else None."""
        a = self.sup.attempt
        if a is None:
            return None
        on: dict[str, set[int]] = {}
        for r in list(a.ranks.values()):
            on.setdefault(r.node, set()).add(r.rank)
        # NOTE: each host's own ranks (as its agent reported them): a group started again keeps its ranks' numbers,
        # and only its records since the regroup are its
        first = [rank_records.first_step_since(self.sup.cfg.run_dir, sorted(on.get(n, ())), since) for n in nodes]
        return None if None in first else min(f for f in first if f is not None)
