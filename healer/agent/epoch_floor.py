"""The node agent's epoch floor: the highest healer epoch it has taken an order of (wire/orders.py `epoch`). An order
of a lower epoch comes from a healer that a newer one took the job from, and is refused. The floor is kept in the
agent's work directory, written durably before the order that raised it is acknowledged, so an agent started again
in the same directory (a replaced agent) refuses the old healer too.

    WORK_DIR/epoch        {"epoch": 4}
"""

from __future__ import annotations

import json
from pathlib import Path

from ground.secretfile import replace_private


class EpochFloor:
    """The highest epoch taken; `path` None: in memory only (an agent without a work directory of its own: tests)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.epoch = self._load()

    def _load(self) -> int:
        if self.path is None or not self.path.exists():
            return 0
        # NOTE: a floor that cannot be read is not taken as 0 (that would let any old healer back in): the agent
        # does not start, and says which file to look at.
        try:
            epoch = json.loads(self.path.read_text())["epoch"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self.path}: the agent's epoch floor cannot be read ({exc}); delete it only if no "
                             "older healer of the job can still send orders") from exc
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"{self.path}: the agent's epoch floor is not an integer >= 0: {epoch!r}")
        return epoch

    def raise_to(self, epoch: int) -> None:
        """Make `epoch` the floor when it is higher, on disk before this returns (written whole, fsynced)."""
        if epoch <= self.epoch:
            return
        if self.path is not None:
            replace_private(self.path, json.dumps({"epoch": epoch}) + "\n")
        self.epoch = epoch
