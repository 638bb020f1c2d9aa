"""The incident lifecycle: the states, and the one table of transitions between them.

    open -> diagnosing -> remediating -> resolved
       \\______________\\______________\\-> escalated -> acknowledged -> resolved

Every active state may also go to `acknowledged` (a person takes it over: the healer stops acting
on it) and to `resolved` (the condition cleared, or a person resolved it). A resolved incident whose
fault comes back within its rule's cool-down is reopened (resolved -> open) rather than duplicated.
Anything else raises `IllegalTransition`.
"""

from __future__ import annotations

import enum

from ground import lifecycle
from healer.errors import IllegalTransition


class IncidentState(str, enum.Enum):
    OPEN = "open"
    """Detected; the healer has not acted yet."""
    DIAGNOSING = "diagnosing"
    """A runbook is running for it."""
    REMEDIATING = "remediating"
    """An action was taken; waiting for the condition to clear."""
    ESCALATED = "escalated"
    """The healer cannot fix it (no remediation, budget spent, deadline passed): a person is paged."""
    ACKNOWLEDGED = "acknowledged"
    """A person owns it; the healer no longer acts on it."""
    RESOLVED = "resolved"
    """The condition cleared or a person resolved it."""


S = IncidentState
TRANSITIONS: dict[IncidentState, frozenset[IncidentState]] = {
    S.OPEN: frozenset({S.DIAGNOSING, S.REMEDIATING, S.ESCALATED, S.ACKNOWLEDGED, S.RESOLVED}),
    S.DIAGNOSING: frozenset({S.REMEDIATING, S.ESCALATED, S.ACKNOWLEDGED, S.RESOLVED}),
    S.REMEDIATING: frozenset({S.ESCALATED, S.ACKNOWLEDGED, S.RESOLVED}),
    S.ESCALATED: frozenset({S.ACKNOWLEDGED, S.RESOLVED}),
    S.ACKNOWLEDGED: frozenset({S.RESOLVED}),
    S.RESOLVED: frozenset({S.OPEN}),
}

ACTIVE_STATES: frozenset[IncidentState] = frozenset(s for s in IncidentState if s is not S.RESOLVED)
# States the healer itself still works on (a person owns acknowledged ones; escalated ones wait for a person).
HEALER_OWNED: frozenset[IncidentState] = frozenset({S.OPEN, S.DIAGNOSING, S.REMEDIATING})


def check_transition(old: IncidentState, new: IncidentState) -> None:
    """Raise IllegalTransition unless the table allows old -> new."""
    lifecycle.check_transition(TRANSITIONS, old, new, "an incident", IllegalTransition)


def parse_state(value: str, field: str = "state") -> IncidentState:
    """A state from its name; ValueError naming the valid ones otherwise."""
    try:
        return IncidentState(value)
    except ValueError:
        raise ValueError(f"{field}: unknown state {value!r}; states: {', '.join(s.value for s in IncidentState)}") from None
