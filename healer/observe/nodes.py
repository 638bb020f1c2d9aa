"""Every node's latest batch, kept once: the NodeBeat by name, and its batch time and the age of its oldest rank
record then as two arrays in the same order, which is what heartbeat_stale compares every cycle.

Why arrays beside the NodeBeat objects: a node is stale when (now - received_at) + max_age_s is past the limit, and
the common case is that no node is. Read off 16,384 NodeBeats (objects spread over the heap, cold in the cache after
a second of ingest) that took ~8 ms a cycle at 131,072 ranks; compared as arrays, well under one. Both are written by
`put` alone, so they cannot part.

The arrays keep the dict's order (first stored first: a node's later batches keep its place), so the i-th entry is
the i-th of `beats()`. Only forgetting nodes reorders them. Not thread-safe: the heartbeat table's lock guards it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # NOTE: heartbeats.py defines NodeBeat and holds this table
    from healer.observe.heartbeats import NodeBeat


class NodeTable:
    def __init__(self, capacity: int = 64) -> None:
        self._beats: dict[str, NodeBeat] = {}
        self._slot: dict[str, int] = {}
        self._received = np.zeros(capacity)
        self._max_age = np.zeros(capacity)

    def get(self, node: str) -> NodeBeat | None:
        return self._beats.get(node)

    def put(self, beat: NodeBeat) -> None:
        """The node's batch just stored (a node not seen before goes last)."""
        node = beat.node
        self._beats[node] = beat
        slot = self._slot.get(node)
        if slot is None:
            slot = self._slot[node] = len(self._slot)
            if slot == len(self._received):
                self._received = np.concatenate([self._received, np.zeros(slot)])
                self._max_age = np.concatenate([self._max_age, np.zeros(slot)])
        self._received[slot] = beat.received_at
        self._max_age[slot] = beat.max_age_s

    def beats(self) -> list[NodeBeat]:
        return list(self._beats.values())

    def times(self) -> tuple[np.ndarray, np.ndarray]:
        """(received_at, max_age_s) of every node, copies, in the order of beats()."""
        n = len(self._slot)
        return self._received[:n].copy(), self._max_age[:n].copy()

    def forget_before(self, cutoff: float) -> list[str]:
        """Drop the nodes whose latest batch came before `cutoff`; returns their names."""
        gone = [n for n, b in self._beats.items() if b.received_at < cutoff]
        if gone:
            for name in gone:
                del self._beats[name]
            nodes = list(self._beats)
            at = np.fromiter((self._slot[n] for n in nodes), dtype=np.intp, count=len(nodes))
            self._received[: len(at)] = self._received[at]
            self._max_age[: len(at)] = self._max_age[at]
            self._slot = {n: i for i, n in enumerate(nodes)}
        return gone

    def __len__(self) -> int:
        return len(self._beats)
