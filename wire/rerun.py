"""A re-run verdict: what megaheal's trainer concluded after re-running a suspect step (train/rerun.py), sent by rank 0
as a `rerun` event, held by the node sidecar until a heartbeat carries it (exporters/ranks.py), and read by the
healer's `sdc` and `rerun` detectors. One struct, imported by both ends.

The verdicts:
- `transient`: the step's second run on the same ranks and batches came out clean: the first was a one-off fault of
  the ranks where the two runs first differ (`ranks`). The clean run's gradients were used: nothing is lost.
- `persistent`: the fault came back, and the ranks where the runs first differ (`ranks`) are faulty: they gave other
  results for the same batches twice, or the same batches gave other results on other ranks and theirs were the
  anomalous ones. The step's update was skipped.
- `data`: the same anomalous result came out of other ranks too, and only some replicas' batches gave it (or only the
  gradients were anomalous, on any ranks): those batches (`samples`) are at fault, not a rank. The step's update was
  skipped; nothing else changes.
- `state`: every replica gave the anomaly, reproducibly, on any ranks: the model's state is already bad (a batch
  before this one poisoned it). The update was skipped; the step's loss is reported as it was, for a rollback.
- `diverged`: the gathered weights of some data-parallel ranks (`ranks`) were not what their group's shards sum to
  (train/param_checksum.py): their copy went bad in their memory or on its way to them. Named the step it happens,
  without a re-run; the update was skipped (their gradients reached every shard at the reduce).
- `inconclusive`: the runs disagreed in a way none of the above explains (both sides of a comparison anomalous, or
  no rank to compare with). The update was skipped.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

log = logging.getLogger(__name__)

EVENT = "rerun"
"""The event's name (EventBody.name)."""

Verdict = Literal["transient", "persistent", "data", "state", "inconclusive", "diverged"]
VERDICTS: tuple[str, ...] = ("transient", "persistent", "data", "state", "inconclusive", "diverged")
Count = Annotated[int, Meta(ge=0, le=2**31)]
Ranks = Annotated[list[Count], Meta(max_length=4096)]


class RerunVerdict(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    step: Count
    """The step that was re-run (0-based)."""
    verdict: Verdict
    what: Literal["nan", "inf", "spike", "gradient", "weights"]
    """What made the step suspect: a NaN or an infinity in a rank's output or loss, a loss far above the step before
    (a spike), or a finite forward with a non-finite gradient."""
    ranks: Ranks = []
    """The ranks the verdict blames (transient, persistent): where the runs' results first differ."""
    flagged: Ranks = []
    """The ranks whose first run was anomalous (their output or loss)."""
    replicas: Ranks = []
    """The data-parallel replicas whose batches were suspect."""
    samples: Annotated[list[Count], Meta(max_length=2 * 4096)] = []
    """The suspect batches as [first, end) pairs of global sample indices (a `data` verdict's skipped samples)."""
    reproduced: bool = False
    """The second run on the same ranks was anomalous too."""
    moved: bool | None = None
    """The third run (the batches moved to other replicas) gave the first run's results (None: not run)."""
    skipped: bool = False
    """The step's update was skipped (the optimizer did not step on it)."""
    seconds: Annotated[float, Meta(ge=0, le=1e6)] = 0.0
    """How long the re-runs took."""
    attempt: Count | None = None


def event_fields(verdict: RerunVerdict) -> dict[str, Any]:
    return msgspec.to_builtins(verdict)  # type: ignore[no-any-return]


def parse(fields: dict[str, Any]) -> RerunVerdict | None:
    """The verdict an event's free-form fields hold; None (logged) when they are not one: they come from a rank."""
    try:
        return msgspec.convert(fields, RerunVerdict)
    except msgspec.ValidationError as exc:
        log.warning("a rerun event that is not a verdict, ignored: %s", exc)
        return None
