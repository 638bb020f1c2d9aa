"""Lifecycles as tables: a thing's states (an Enum) and, for each, the states it may go to. One check for every
lifecycle of the project (an incident's, an attempt's): a change the table does not have is refused, logged and
raised, naming what may follow instead."""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import TypeVar

log = logging.getLogger(__name__)
E = TypeVar("E", bound=enum.Enum)


def check_transition(table: Mapping[E, frozenset[E]], old: E, new: E, what: str,
                     error: type[Exception] = ValueError) -> None:
    """Raise `error` unless `table` allows `old` -> `new` for `what` ("an incident", "attempt 4")."""
    if new not in table[old]:
        allowed = ", ".join(sorted(str(s.value) for s in table[old])) or "none"
        log.warning("illegal transition of %s: %s -> %s refused", what, old.value, new.value)
        raise error(f"{what} cannot go from {old.value} to {new.value} (from {old.value}: {allowed})")
