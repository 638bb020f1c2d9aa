"""Where a job runs: its hosts and data-parallel degree, its spares, the hosts the healer left out of it and the steps
whose batches it passes over. One value, owned by the job's remediator (healer/launchers/remediator.py) and replaced
whole at each change (another thread reads it: `state()`), each change a method here."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from ground.names import check_name


@dataclass(frozen=True, slots=True)
class Placement:
    nodes: tuple[str, ...]
    """The current (or next) attempt's hosts, in node-rank order."""
    spares: tuple[str, ...] = ()
    """Idle hosts that can replace one left out."""
    dp: int = 1
    excluded: frozenset[str] = frozenset()
    """Hosts the healer left out of this job: their faults are known and no longer the job's."""
    skip_steps: frozenset[int] = frozenset()
    """Steps whose batches every later attempt passes over (rollbacks accumulate)."""
    kept_out: frozenset[str] = frozenset()
    """Those of `excluded` that no screening takes back (a lemon, a host convicted of silent data corruption)."""

    def __post_init__(self) -> None:
        if not self.nodes or set(self.nodes) & set(self.spares):
            raise ValueError(f"a job's hosts must be some and none of them a spare: {self.nodes}, spares {self.spares}")
        for node in (*self.nodes, *self.spares):
            check_name(node, "node")
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")

    def leaving_out(self, nodes: tuple[str, ...], released: tuple[str, ...], kept_out: tuple[str, ...] = ()
                    ) -> Placement:
        """A restart onto `nodes` is ordered: the current hosts it neither keeps nor releases are out from now on
        (not once the old attempt is stopped: a lasting fault of such a host must not read as no job's meanwhile);
        `kept_out` of them for good."""
        return replace(self, excluded=self.excluded | (set(self.nodes) - set(nodes) - set(released)),
                       kept_out=self.kept_out | frozenset(kept_out))

    def returnable(self) -> tuple[str, ...]:
        """The hosts left out that a passing screening takes back (a repaired host)."""
        return tuple(sorted(self.excluded - self.kept_out))

    def taking_back(self, nodes: Iterable[str]) -> Placement:
        """`nodes`, left out before, passed their screening: spares again."""
        back = [n for n in sorted(nodes) if n in self.excluded and n not in self.kept_out]
        return replace(self, spares=self.spares + tuple(back), excluded=self.excluded - set(back))

    def grown(self, full: int, full_dp: int, valid_dp: tuple[int, ...]) -> tuple[tuple[str, ...], int] | None:
        """(hosts, dp) of the largest job this one can grow back to with its idle spares, up to the `full` hosts at
        `full_dp` it was meant to run on; None when it cannot grow (it is whole, no spare, no larger valid degree)."""
        for n in range(min(full, len(self.nodes) + len(self.spares)), len(self.nodes), -1):
            dp, rest = divmod(full_dp * n, full)
            if rest == 0 and dp > self.dp and (not valid_dp or dp in valid_dp):
                return self.nodes + self.spares[:n - len(self.nodes)], dp
        return None

    def skipping(self, steps: tuple[int, ...] | frozenset[int]) -> Placement:
        return replace(self, skip_steps=self.skip_steps | frozenset(steps))

    def moved_to(self, nodes: tuple[str, ...], dp: int, released: tuple[str, ...]) -> tuple[Placement, set[str]]:
        """The job restarts on `nodes` at `dp`: spares it takes are spares no more, hosts it releases (healthy, idle
        now) are spares again, and the rest it leaves are out. The new placement, and the hosts it left out."""
        left_out = set(self.nodes) - set(nodes) - set(released)
        spares = tuple(s for s in self.spares if s not in nodes) + tuple(n for n in released if n not in self.spares)
        return replace(self, nodes=tuple(nodes), dp=dp, spares=spares, excluded=self.excluded | left_out), left_out

    def taken_over(self, nodes: tuple[str, ...] | None, dp: int | None, spares: tuple[str, ...],
                   excluded: set[str], skip_steps: set[int]) -> Placement:
        """What a healer that takes the job over goes on with: the last attempt's hosts and degree (from the journal;
        None: the configured ones), as spares the hosts it has (`spares`: its configured ones, or every host of a
        successor's allocation) that are neither in it nor left out, and what the healer before had left out and
        skipped (from the database)."""
        nodes = nodes or self.nodes
        return Placement(nodes=nodes, dp=dp or self.dp, spares=tuple(n for n in spares if n not in nodes and
                                                                      n not in excluded),
                         excluded=frozenset(excluded), skip_steps=frozenset(skip_steps))

    def skip_override(self, extra: tuple[int, ...] | frozenset[int] = ()) -> tuple[str, ...]:
        """The `--set` item that makes an attempt pass over the skipped batches (and `extra`), if any."""
        skip = self.skip_steps | frozenset(extra)
        return (f"skip_steps=[{','.join(map(str, sorted(skip)))}]",) if skip else ()
