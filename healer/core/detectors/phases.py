"""The phase table: per rank, the median of each phase over its last samples, and the ratios the straggler
and collective-slowdown detectors reason with.

On CPU, the data-parallel collectives are timed inside themselves: the parameter all-gather that starts a
ZeRO-2 step (`dp_gather`) and the gradient reduce (`dp_reduce`), each the transfer plus the time a rank waits
there for the latest one. Their sum is the row's `dp_reduce_s`: its smallest value in a step is about the
transfer (what bandwidth costs), and the rest of each rank's is waiting. A rank that computes slowly (or
starts late) has the longest compute and the *shortest* collective time: everyone else waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from healer.core.detectors.history import RankSeries, median

# NOTE: not `grad_norm_clip`: the global gradient norm is all-reduced over the data-parallel and pipeline groups,
# so that phase is mostly a wait for the other stages' reduce. Counted as compute, a slow link under one stage made
# every rank of the other stage look slow (0.55 s of 0.6 s on the bed).
COMPUTE_PHASES = ("forward_backward", "optimizer")


@dataclass(frozen=True, slots=True)
class RankRow:
    rank: int
    node: str
    samples: int
    step_s: float
    compute_s: float
    data_wait_s: float
    dp_reduce_s: float
    reduce_lag_s: float | None
    stage: int = 0

    def to_payload(self) -> dict[str, object]:
        return {"rank": self.rank, "node": self.node, "stage": self.stage, "samples": self.samples,
                "step_s": round(self.step_s, 4),
                "compute_s": round(self.compute_s, 4), "data_wait_s": round(self.data_wait_s, 4),
                "dp_reduce_s": round(self.dp_reduce_s, 4),
                "reduce_lag_s": round(self.reduce_lag_s, 4) if self.reduce_lag_s is not None else None}


def phase_table(series: list[RankSeries], window: int, since_step: int | None = None) -> list[RankRow]:
    """One row per rank with at least one sample, from its last `window` samples (after `since_step`)."""
    rows = []
    for s in series:
        samples = [x for x in list(s.samples)[-window:] if since_step is None or x.step > since_step]
        samples = [x for x in samples if x.step_seconds is not None and x.phases]
        if not samples:
            continue
        lags = [x.dp_reduce_lag_s for x in samples if x.dp_reduce_lag_s is not None]
        rows.append(RankRow(
            rank=s.rank, node=s.node, samples=len(samples),
            step_s=median([x.step_seconds for x in samples if x.step_seconds is not None]),
            compute_s=median([sum(x.phases.get(p, 0.0) for p in COMPUTE_PHASES) for x in samples]),
            data_wait_s=median([x.phases.get("data_wait", 0.0) for x in samples]),
            dp_reduce_s=median([x.phases.get("dp_reduce", 0.0) + x.phases.get("dp_gather", 0.0) for x in samples]),
            reduce_lag_s=median(lags) if lags else None, stage=s.stage))
    return rows
