"""The detector interface.

A detector is built once per rule from its typed `Config` (the rule's `when:` parameters) and then
called every detection cycle with the heartbeat table and the time. It returns what is faulty
(`firing`, one `Finding` per thing, keyed) and what it positively saw healthy (`healthy` keys). The
engine opens or joins an incident per firing key and resolves incidents whose key is healthy; a key
that is neither (e.g. a node the healer stopped hearing of) keeps its incident as it is, because
silence is not evidence of recovery.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from healer.core.jobview import Readings


@dataclass(frozen=True, slots=True)
class Finding:
    """One faulty thing: its key (stable across cycles), where it is and the evidence."""

    key: str
    job: str | None
    node: str | None
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Evaluation:
    firing: tuple[Finding, ...] = ()
    healthy: frozenset[str] = frozenset()


class Detector(ABC):
    """Base class; subclasses set `name`, nest `@dataclass(kw_only=True, slots=True) class Config`."""

    name: ClassVar[str]
    reads_processes: ClassVar[bool] = False
    """Whether its findings come from the launcher's view of the processes (exits) rather than from heartbeats: a
    job whose current attempt has not reported yet (it is starting) can only be faulted by such a detector, since
    what the others remember is the previous attempt's."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        pass

    def __init__(self, config: Any) -> None:
        self.config = config

    @abstractmethod
    def evaluate(self, table: Readings, now: float) -> Evaluation:
        """One detection cycle over the whole table. Must not block: it runs on the scheduler every second."""
