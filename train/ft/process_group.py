"""The process group across replica groups, made so that a Lighthouse that was started again does not break it.

torchft (0.2.0) forms the process group of each quorum under the key prefix `torchft/<quorum id>/<rank>` in the
quorum's first group's store, and a Lighthouse numbers its quorums from 1 when it starts. So after a Lighthouse was
started again (its keeper does, healer/runner/lighthouse.py) the groups meet under prefixes an earlier quorum used:
the first to arrive reads the addresses the members of that quorum left there, long gone, and fails ("Connection
refused"; seen on the bed, where a group then failed at every quorum until the numbers passed the old ones).

Here the prefix also carries what one quorum's members agree on and an earlier quorum of the same number does not
share: the step the quorum is for and its members' replica ids (each a UUID per manager's start). The quorum is
read where the manager gets it (its client's `_quorum`, wrapped); the process group is otherwise torchft's own.
Written here because torchft exposes neither a hook nor a setting for the prefix.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from torchft import ProcessGroupGloo, ProcessGroupNCCL


class QuorumSeen:
    """A manager's client, remembering the last quorum it was given (everything else passed through)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        with self._lock:
            self._last = quorum
        return quorum

    def salt(self) -> str:
        """What the members of the last quorum agree on: its step and its members."""
        with self._lock:
            q = self._last
        if q is None:
            return "none"
        members = ",".join(sorted(q.replica_ids))
        return f"s{q.max_step}-{hashlib.sha256(members.encode()).hexdigest()[:16]}"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class _Salted:
    seen: QuorumSeen | None = None

    def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
        salt = self.seen.salt() if self.seen is not None else "none"
        super().configure(f"{store_addr}/{salt}", *args, **kwargs)  # type: ignore[misc]


class SaltedGloo(_Salted, ProcessGroupGloo):
    pass


class SaltedNCCL(_Salted, ProcessGroupNCCL):
    pass


def watch(manager: Any, pg: _Salted) -> None:
    """Have `pg` salt its prefixes with the quorums `manager` is given."""
    seen = QuorumSeen(manager._client)
    manager._client = seen
    pg.seen = seen
