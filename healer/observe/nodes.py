"""Each node's latest batch time and the age of its oldest rank record then, as two arrays in the heartbeat table's
order of its nodes: what heartbeat_stale compares every cycle.

Why arrays beside the table's NodeBeat objects: a node is stale when (now - received_at) + max_age_s is past the
limit, and the common case is that no node is. Read off 16,384 NodeBeats (objects spread over the heap, cold in the
cache after a second of ingest) that took ~8 ms a cycle at 131,072 ranks; compared as arrays, well under one.

The arrays keep the table's dict order (first stored first: a node's later batches keep its place), so the i-th
entry is the i-th of the table's `nodes()`. Only forgetting nodes reorders them (`keep_only`, after the table has
dropped them). Not thread-safe: the table's lock guards it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NodeTimes:
    def __init__(self, capacity: int = 64) -> None:
        self._slot: dict[str, int] = {}
        self._received = np.zeros(capacity)
        self._max_age = np.zeros(capacity)

    def set(self, node: str, received_at: float, max_age_s: float) -> None:
        """The node's batch just stored (a node not seen before goes last, as it does in the table's dict)."""
        slot = self._slot.get(node)
        if slot is None:
            slot = self._slot[node] = len(self._slot)
            if slot == len(self._received):
                self._received = np.concatenate([self._received, np.zeros(slot)])
                self._max_age = np.concatenate([self._max_age, np.zeros(slot)])
        self._received[slot] = received_at
        self._max_age[slot] = max_age_s

    def keep_only(self, nodes: Sequence[str]) -> None:
        """After the table dropped nodes: the ones left, in the table's order."""
        at = np.fromiter((self._slot[n] for n in nodes), dtype=np.intp, count=len(nodes))
        self._received[: len(at)] = self._received[at]
        self._max_age[: len(at)] = self._max_age[at]
        self._slot = {n: i for i, n in enumerate(nodes)}

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """(received_at, max_age_s) of every node, copies, by the table's order."""
        n = len(self._slot)
        return self._received[:n].copy(), self._max_age[:n].copy()
