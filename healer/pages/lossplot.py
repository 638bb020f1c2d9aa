"""Loss and step over the run's wall time, from the lowest rank's records: one line per attempt, each attempt a
band, each incident a line at its detection. A restart from an older checkpoint shows as the step line dropping
back (the steps run again were lost work); a NaN loss is a mark at the top of the loss panel. Geometry only."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from healer.pages.axes import Scale, label, place_labels, ticks
from healer.pages.rundir import RunDir
from healer.pages.waterfall import Marker, markers

LEFT, WIDTH, TOP = 60, 760, 12
LOSS_H, STEP_H, GAP = 170, 90, 26
MARK_ROWS = 3
"""Rows of incident labels at the top of the loss panel."""
ATTEMPT_COLOURS = ("#2166ac", "#b2182b", "#1b7837", "#762a83", "#e08214", "#35978f")


@dataclass(frozen=True, slots=True)
class Line:
    attempt: int
    colour: str
    loss_points: str
    """SVG polyline points of the loss panel."""
    step_points: str


@dataclass(frozen=True, slots=True)
class Band:
    x: float
    w: float
    attempt: int
    text: str
    shade: bool
    labelled: bool = True
    """Whether its "aN" label has room under it (healer.pages.axes.place_labels)."""


@dataclass(frozen=True, slots=True)
class LossPlot:
    width: float
    height: float
    loss_top: float
    loss_bottom: float
    step_top: float
    step_bottom: float
    lines: list[Line]
    bands: list[Band]
    marks: list[Marker]
    nan_marks: list[tuple[float, str]]
    x_axis: list[tuple[float, str]]
    loss_axis: list[tuple[float, str]]
    step_axis: list[tuple[float, str]]
    rank: int


def build(run: RunDir, incidents: list[tuple[int, str, float]]) -> LossPlot | None:
    """`incidents`: (id, kind, detected_at). None when the run has no attempt or no record."""
    attempts = run.attempts()
    ranks = run.rank_numbers()
    records = run.records(ranks[0]) if ranks else []
    if not attempts or not records:
        return None
    t0 = attempts[0].started_at
    t1 = max([records[-1].time, *(a.ended_at for a in attempts if a.ended_at is not None)])
    x = Scale(0.0, t1 - t0, LEFT, LEFT + WIDTH)
    finite = [r.loss for r in records if r.loss is not None and math.isfinite(r.loss)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    loss_y = Scale(lo, hi if hi > lo else lo + 1, TOP + LOSS_H, TOP)
    step_top = TOP + LOSS_H + GAP
    top_step = max(r.step for r in records)
    step_y = Scale(0.0, max(top_step, 1), step_top + STEP_H, step_top)
    by_attempt: dict[int, list[tuple[float, float | None, int]]] = {}
    nan_marks = []
    for r in records:
        a = run.attempt_at(r.time - r.step_seconds)
        by_attempt.setdefault(a.number if a else 0, []).append((r.time - t0, r.loss, r.step))
        if r.loss is not None and not math.isfinite(r.loss):
            nan_marks.append((x(r.time - t0), f"step {r.step}: loss {r.loss}"))
    lines = [Line(n, ATTEMPT_COLOURS[n % len(ATTEMPT_COLOURS)],
                  " ".join(f"{x(t)},{loss_y(v)}" for t, v, _ in pts if v is not None and math.isfinite(v)),
                  " ".join(f"{x(t)},{step_y(s)}" for t, _, s in pts)) for n, pts in sorted(by_attempt.items())]
    bands = [Band(x(a.started_at - t0), round(x((a.ended_at or t1) - t0) - x(a.started_at - t0), 2), a.number,
                  f"attempt {a.number}: {', '.join(a.nodes)}", a.number % 2 == 1) for a in attempts]
    room = place_labels([(b.x + 3, f"a{b.attempt}") for b in bands], 1)
    bands = [replace(b, labelled=row is not None) for b, row in zip(bands, room, strict=True)]
    marks = markers([(x(at - t0), i, f"#{i} {kind}") for i, kind, at in incidents if t0 <= at <= t1], MARK_ROWS)
    return LossPlot(width=LEFT + WIDTH + 20, height=step_top + STEP_H + 30, loss_top=TOP, loss_bottom=TOP + LOSS_H,
                    step_top=step_top, step_bottom=step_top + STEP_H, lines=lines, bands=bands, marks=marks,
                    nan_marks=nan_marks, x_axis=[(x(t), f"{label(t)} s") for t in ticks(0.0, t1 - t0, 8)],
                    loss_axis=[(loss_y(v), label(v)) for v in ticks(lo, hi, 4)],
                    step_axis=[(step_y(v), label(v)) for v in ticks(0.0, top_step, 3)], rank=ranks[0])
