"""Pairwise tests: which pairs to test in which round, and who to blame for the slow pairs.

Rounds follow the circle method of a round-robin tournament: n nodes are tested in n-1 rounds (n
even; a bye is added for odd n) of disjoint pairs, so every pair is tested once and each node is
busy with one partner at a time. A slow node makes every pair it is part of slow; a slow link
makes only its own pair slow. That is how the two are told apart (this needs at least 3 nodes;
with 2 nodes only a baseline can call the one pair slow, and it is reported as a link).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from wire.verdict import Suspect


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint (a, b) pairs, a < b, covering every pair of range(n) exactly once."""
    if n < 2:
        return []
    slots = list(range(n)) + ([None] if n % 2 else [])
    m = len(slots)
    rounds = []
    for _ in range(m - 1):
        pairs = []
        for i in range(m // 2):
            a, b = slots[i], slots[m - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        # Keep the first slot fixed and rotate the rest by one.
        slots = [slots[0], slots[-1], *slots[1:-1]]
    return rounds


@dataclass(frozen=True, slots=True)
class PairVerdict:
    """The slow pairs and what they point at."""

    slow_pairs: list[tuple[int, int]]
    suspects: list[Suspect]
    reference_source: str  # "baseline" or "peers"


def attribute(
    busbw: dict[tuple[int, int], float], names: list[str], fraction: float, baseline: float | None = None
) -> PairVerdict:
    """Blame slow nodes, then links for slow pairs that no slow node explains.

    With a stored baseline the comparison is absolute: a pair is slow below `fraction` x baseline,
    a node whose every pair is slow is blamed. Without one it is local, so that a machine whose
    speed drifts as a whole does not blame anyone: a node is slow when the median of its pairs is
    below `fraction` x the median of the pairs it is not part of, and a pair is slow when it is below
    `fraction` x what both of its nodes reach with their other (healthy) partners.
    """
    if not busbw:
        return PairVerdict([], [], "none")
    if baseline:
        return _absolute(busbw, names, fraction, baseline)
    nodes = range(len(names))
    slow_nodes: list[int] = []
    suspects: list[Suspect] = []
    if len(names) >= 3:
        for node in nodes:
            mine = [v for p, v in busbw.items() if node in p]
            others = [v for p, v in busbw.items() if node not in p]
            if mine and others and median(mine) < fraction * median(others):
                slow_nodes.append(node)
                suspects.append(
                    Suspect(
                        kind="node",
                        name=names[node],
                        reason=(
                            f"median pair busbw {median(mine) / 1e9:.3g} GB/s < {fraction:g} x "
                            f"{median(others) / 1e9:.3g} GB/s among the other nodes"
                        ),
                    )
                )
    slow_pairs = []
    for (a, b), value in sorted(busbw.items()):
        if a in slow_nodes or b in slow_nodes:
            slow_pairs.append((a, b))
            continue
        refs = [median(o) for o in (_healthy_partners(busbw, x, (a, b), slow_nodes) for x in (a, b)) if o]
        if refs and value < fraction * min(refs):
            slow_pairs.append((a, b))
            suspects.append(
                Suspect(
                    kind="link",
                    name=f"{names[a]}<->{names[b]}",
                    reason=(
                        f"pair busbw {value / 1e9:.3g} GB/s < {fraction:g} x {min(refs) / 1e9:.3g} GB/s that its nodes "
                        "reach with other partners"
                    ),
                )
            )
    return PairVerdict(slow_pairs, suspects, "peers")


def _healthy_partners(
    busbw: dict[tuple[int, int], float], node: int, skip: tuple[int, int], slow_nodes: list[int]
) -> list[float]:
    return [v for p, v in busbw.items() if node in p and p != skip and not set(p) & set(slow_nodes)]


def _absolute(busbw: dict[tuple[int, int], float], names: list[str], fraction: float, baseline: float) -> PairVerdict:
    floor = fraction * baseline
    slow = sorted(p for p, v in busbw.items() if v < floor)
    suspects, slow_nodes = [], set()
    if len(names) >= 3:
        for node in range(len(names)):
            mine = [p for p in busbw if node in p]
            if mine and all(p in slow for p in mine):
                slow_nodes.add(node)
                suspects.append(
                    Suspect(
                        kind="node",
                        name=names[node],
                        reason=(
                            f"all {len(mine)} of its pairs below {fraction:g} x baseline {baseline / 1e9:.3g} GB/s "
                            f"(best {max(busbw[p] for p in mine) / 1e9:.3g})"
                        ),
                    )
                )
    for a, b in slow:
        if a not in slow_nodes and b not in slow_nodes:
            suspects.append(
                Suspect(
                    kind="link",
                    name=f"{names[a]}<->{names[b]}",
                    reason=(
                        f"pair busbw {busbw[(a, b)] / 1e9:.3g} GB/s < {fraction:g} x baseline {baseline / 1e9:.3g} GB/s"
                        + ("" if len(names) >= 3 else "; with 2 nodes a slow node cannot be told from a slow link")
                    ),
                )
            )
    return PairVerdict(slow, suspects, "baseline")
