"""Who a finding blames: its suspects, typed. A suspect is a host, a rank, a rank on its host, or a GPU of a host.

The decisions that follow a finding read only these: which hosts a runbook diagnoses first, which a lemon count
charges, which a drain may take out (healer/engine/respond.py, healer/launchers/drain.py). They travel with the
finding into its signal and are kept in the incident's own `suspects` column, typed on both ends by `encode` and
`decode`. An incident's evidence stays free-form, for people: the `suspect_*` keys in it are made from the suspects
by `shown` (one place, one shape for every detector), never read back to decide anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec


class Suspect(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    node: str | None = None
    """The host (None: a rank whose host is not known)."""
    rank: int | None = None
    """The rank of the job (None: the host itself, or a GPU of it)."""
    gpu: int | None = None
    """The GPU's index on the host, for a fault of one GPU."""

    def __post_init__(self) -> None:
        if self.node is None and self.rank is None:
            raise ValueError("a suspect names a host or a rank")


Suspects = tuple[Suspect, ...]


def nodes(suspects: Iterable[Suspect]) -> list[str]:
    """The hosts named, sorted, each once."""
    return sorted({s.node for s in suspects if s.node is not None})


def ranks(suspects: Iterable[Suspect]) -> list[int]:
    """The ranks named, sorted, each once."""
    return sorted({s.rank for s in suspects if s.rank is not None})


def on_hosts(names: Iterable[str]) -> Suspects:
    """A suspect per host of `names` (each once, sorted)."""
    return tuple(Suspect(node=n) for n in sorted(set(names)))


def shown(suspects: Suspects) -> dict[str, Any]:
    """The suspects as an incident's evidence shows them to people: every rank and host as lists, and the one rank
    or host alone where there is just one (the pages, the run report and the tools read these)."""
    if not suspects:
        return {}
    named_ranks, named_nodes = ranks(suspects), nodes(suspects)
    out: dict[str, Any] = {"suspect_ranks": named_ranks, "suspect_nodes": named_nodes}
    if len(named_ranks) == 1:
        out["suspect_rank"] = named_ranks[0]
    if len(named_nodes) == 1:
        out["suspect_node"] = named_nodes[0]
    return out


def encode(suspects: Suspects) -> list[dict[str, Any]]:
    """For the incident's JSON column."""
    return msgspec.to_builtins(list(suspects))  # type: ignore[no-any-return]


def decode(value: Any, where: str) -> Suspects:
    """The suspects kept in a JSON column (None: none). Raises ValueError naming `where` (which incident) and what
    is wrong, rather than deciding on a half-read list."""
    if value is None:
        return ()
    try:
        return tuple(msgspec.convert(value, list[Suspect]))
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"{where}: suspects {value!r} are not a list of suspects: {exc}") from exc
