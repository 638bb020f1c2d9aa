"""The node agent's order book on disk: each order's id, kind, digest and state, so that an agent started again in the
same work directory (a replaced agent) answers a retried order with what became of it instead of carrying it out a
second time, and still refuses an id reused for another order.

    WORK_DIR/orders.jsonl   one line per change of an order's state, the newest line of an id wins:
        {"digest": "<sha256 of the order>", "state": {"id": ..., "kind": ..., "status": ..., "result": ..., ...}}

Appended (and fsynced) before the agent answers; rewritten whole, with the newest `keep` orders only, when it has
grown to twice that, and when it is loaded. An order that was queued or running when its agent died is loaded as
failed: whether it did anything is unknown, so it is never carried out again.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from pathlib import Path

import msgspec

from ground.secretfile import replace_private
from wire.orders import Order, OrderState

MAX_RESULT = 64 * 1024
"""A result larger than this (a runbook's output, a hang's stacks) is not kept on disk: a question asked again, not
an action; after a restart its order reads as failed, saying so."""
_encode_order = msgspec.json.Encoder(order="deterministic").encode


def digest(order: Order) -> str:
    """What tells two orders of one id apart (every field, the epoch included)."""
    return hashlib.sha256(_encode_order(order)).hexdigest()


class Entry(msgspec.Struct, kw_only=True):
    digest: str
    state: OrderState


class OrderLog:
    def __init__(self, path: Path, keep: int) -> None:
        self.path, self.keep = path, keep
        self._latest: OrderedDict[str, bytes] = OrderedDict()
        """Each order's newest line, oldest order first: what a compaction writes."""
        self._lines = 0

    def load(self) -> list[Entry]:
        """The orders on disk, oldest first (the newest `keep`), an unfinished one as failed; the file compacted."""
        entries: OrderedDict[str, Entry] = OrderedDict()
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = b""
        for line in raw.splitlines():
            try:
                entry = msgspec.json.decode(line, type=Entry)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # NOTE: a line cut short by the agent's death; the ones around it still count
            entries[entry.state.id] = entry
        for entry in entries.values():
            if entry.state.status in ("accepted", "running"):
                when = "while it ran" if entry.state.status == "running" else "before it ran"
                entry.state.status, entry.state.error = "failed", f"the agent restarted {when}"
        kept = list(entries.values())[-self.keep:]
        self._latest = OrderedDict((e.state.id, self._line(e)) for e in kept)
        self._compact()
        return kept

    def append(self, order_digest: str, state: OrderState) -> None:
        """Record the order's state now, durably."""
        line = self._line(Entry(digest=order_digest, state=state))
        self._latest[state.id] = line  # NOTE: an order known already keeps its place (when it came)
        while len(self._latest) > self.keep:
            self._latest.popitem(last=False)
        if self._lines >= 2 * self.keep:
            self._compact()
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._lines += 1

    def _compact(self) -> None:
        # NOTE: also what drops a line cut short by the agent before (load compacts): every append after it starts
        # on a line of its own.
        replace_private(self.path, b"".join(self._latest.values()).decode())
        self._lines = len(self._latest)

    @staticmethod
    def _line(entry: Entry) -> bytes:
        line = msgspec.json.encode(entry)
        if len(line) > MAX_RESULT and entry.state.result is not None:
            state = msgspec.structs.replace(entry.state, result=None, status="failed",
                                            error=f"its result ({len(line)} bytes) was not kept over the agent's "
                                                  "restart: ask again")
            line = msgspec.json.encode(Entry(digest=entry.digest, state=state))
        return line + b"\n"
