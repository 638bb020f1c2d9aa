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
from collections.abc import Callable, Iterable, Iterator, Set
from dataclasses import dataclass, field
from typing import Any, ClassVar

from healer.detect.suspects import Suspects, shown
from healer.observe.jobview import Readings


@dataclass(frozen=True, slots=True)
class Finding:
    """One faulty thing: its key (stable across cycles), where it is, whom it blames and the evidence."""

    key: str
    job: str | None
    node: str | None
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    """For people (the incident's page, the run report): free-form. Made to show the suspects too (`shown`)."""
    labels: dict[str, str] = field(default_factory=dict)
    suspects: Suspects = ()
    """Whom the finding blames (healer/detect/suspects.py): what the decisions after it read, never the evidence."""
    first_bad_step: int | None = None
    """The first step the fault touched (a non-finite loss, a spike): a rollback resumes before it and skips its
    batches (healer/decide/plans.py). Shown in the evidence as `first_step`."""

    def __post_init__(self) -> None:
        if self.suspects or self.first_bad_step is not None:
            first = {} if self.first_bad_step is None else {"first_step": self.first_bad_step}
            object.__setattr__(self, "evidence", {**self.evidence, **first, **shown(self.suspects)})


class LazyKeys(Set[str]):
    """Healthy keys made only when something asks for them: `make()` once, on the first membership test or pass.
    NOTE: a detector whose healthy keys are every GPU or every node (131,072 and 16,384 at the largest) spent tens
    of milliseconds a cycle making them, where the engine looks up only the keys of its open incidents (none, nearly
    always: then nothing is made)."""

    __slots__ = ("_keys", "_make")

    def __init__(self, make: Callable[[], Iterable[str]]) -> None:
        self._make: Callable[[], Iterable[str]] | None = make
        self._keys: frozenset[str] = frozenset()

    def _made(self) -> frozenset[str]:
        if self._make is not None:
            self._keys, self._make = frozenset(self._make()), None
        return self._keys

    def __contains__(self, key: object) -> bool:
        return key in self._made()

    def __iter__(self) -> Iterator[str]:
        return iter(self._made())

    def __len__(self) -> int:
        return len(self._made())

    @classmethod
    def _from_iterable(cls, it: Iterable[str]) -> frozenset[str]:  # type: ignore[override]
        return frozenset(it)  # what `fired & healthy` and the like make


@dataclass(frozen=True, slots=True)
class Evaluation:
    firing: tuple[Finding, ...] = ()
    healthy: Set[str] = frozenset()
    """The keys seen healthy (a frozenset, or LazyKeys where making them all would cost)."""


class Detector(ABC):
    """Base class; subclasses set `name`, nest `@dataclass(kw_only=True, slots=True) class Config`."""

    name: ClassVar[str]
    reads_processes: ClassVar[bool] = False
    """Whether its findings come from the launcher's view of the processes (exits) rather than from heartbeats: a
    job whose current attempt has not reported yet (it is starting) can only be faulted by such a detector, since
    what the others remember is the previous attempt's."""

    measures_silence: ClassVar[bool] = False
    """Whether it faults a job for silence or a lack of progress (heartbeat_stale, host_lost, hang): such findings
    are not the job's while the healer itself stops, diagnoses or starts it (Healer.evaluate_detectors)."""

    blinds: ClassVar[bool] = False
    """Whether its findings say the healer cannot hear a job's hosts (healer_blind): while one stands, the job's
    silence is the healer's, and the findings of the detectors that measure silence are dropped for it."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        pass

    def __init__(self, config: Any) -> None:
        self.config = config

    @abstractmethod
    def evaluate(self, table: Readings, now: float) -> Evaluation:
        """One detection cycle over the whole table. Must not block: it runs on the scheduler every second."""
