"""The heat map of an incident: per rank (rows) and step (columns), around the incident, each rank's compute time
relative to the fastest rank of its pipeline stage at that step; and each rank's phase split over those steps.

Why compute and not step time: in synchronous training every rank's step takes as long as the slowest one's (the
others wait for it in the collectives), so step time is the same on every row. The slow rank is the one whose
compute (forward/backward and optimizer: healer.detect.phases.COMPUTE_PHASES) is long
while its collective waits are short. A silent rank (crashed, frozen) is the row whose records stop early.
NOTE: pipeline sends and receives are timed inside forward/backward (torch's schedules do not expose them), so
the pipeline peers of a slow rank look slow as well, if less so; the suspect row is marked.

Geometry only: the template (charts.html) draws it, escaping every label.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from healer.detect.phases import COMPUTE_PHASES
from healer.pages.axes import Scale
from healer.pages.rundir import Attempt, RunDir, StepRecord
from wire.telemetry import ordered_phases

BEFORE, AFTER = 24, 6
"""Steps shown before and after the last step finished before detection."""
MAX_ROWS = 48
"""At most this many ranks: the suspects, then the ones that stand out most (a 12,288-rank job has no room)."""
LABEL_W, CELL_H, TOP = 220, 18, 22
STOPS = ((1.25, "#efe9df"), (1.5, "#fdd49e"), (2.0, "#fc8d59"), (3.0, "#d7301f"), (float("inf"), "#7f0000"))
"""(upper bound of the ratio, colour): the legend's buckets."""
MISSING = "#4d4d4d"
PHASE_COLOURS = {"data_wait": "#bdbdbd", "dp_gather": "#9ecae1", "forward_backward": "#e6550d",
                 "pp_wait": "#c6dbef", "dp_reduce": "#3182bd", "grad_norm_clip": "#fd8d3c", "optimizer": "#a63603",
                 "checkpoint": "#31a354"}


@dataclass(frozen=True, slots=True)
class Cell:
    x: float
    y: float
    fill: str
    ratio: float | None
    title: str


@dataclass(frozen=True, slots=True)
class Row:
    rank: int
    node: str
    stage: int
    y: float
    suspect: bool
    worst: float | None
    """The row's highest ratio in the window (None: no record in it)."""


@dataclass(frozen=True, slots=True)
class Segment:
    x: float
    y: float
    w: float
    fill: str
    title: str


@dataclass(frozen=True, slots=True)
class HeatMap:
    width: float
    height: float
    cell_w: float
    cell_h: float
    label_w: float
    rows: list[Row]
    cells: list[Cell]
    columns: list[tuple[float, int]]
    """(x, step) of the labelled columns."""
    marker_x: float | None
    """The column of the last step finished before detection."""
    attempt: int
    ranks_total: int
    split_width: float
    segments: list[Segment]
    """The phase split: one stacked bar per row (median seconds of each phase over the window)."""
    phases: list[tuple[str, str]]
    """(phase, colour) in the trainer's order, for the legend."""

    @property
    def legend(self) -> list[tuple[str, str]]:
        bounds = [1.0, *(b for b, _ in STOPS[:-1])]
        return [(f"{lo:g}-{hi:g}x" if hi != float("inf") else f">{lo:g}x", colour)
                for lo, (hi, colour) in zip(bounds, STOPS)] + [("no record", MISSING)]


def compute_s(r: StepRecord) -> float:
    return sum(r.phases.get(p, 0.0) for p in COMPUTE_PHASES) if r.phases else r.step_seconds


def colour(ratio: float) -> str:
    return next(c for bound, c in STOPS if ratio < bound)


def build(run: RunDir, attempt: Attempt, detected_at: float, suspects: list[int],
          known_nodes: dict[int, str] | None = None) -> HeatMap | None:
    """The heat map of the attempt an incident happened in, around its detection; None without records.
    `known_nodes`: rank -> host as the incident's evidence names them (for journals that do not)."""
    end = attempt.ended_at if attempt.ended_at is not None else float("inf")
    by_rank: dict[int, dict[int, StepRecord]] = {}
    for rank in run.rank_numbers():
        by_rank[rank] = {r.step: r for r in run.records(rank) if attempt.started_at <= r.time - r.step_seconds
                         and r.time <= end}
    steps = sorted({s for recs in by_rank.values() for s in recs})
    if not steps:
        return None
    finished = [s for recs in by_rank.values() for s, r in recs.items() if r.time <= detected_at]
    anchor = max(finished) if finished else steps[0]
    window = [s for s in steps if anchor - BEFORE <= s <= anchor + AFTER]
    ratios = _ratios(by_rank, window)
    chosen = _choose(by_rank, ratios, suspects)
    cell_w = max(8.0, min(22.0, 640 / len(window)))
    x = Scale(window[0], window[-1] + 1, LABEL_W, LABEL_W + cell_w * (len(window)))
    rows, cells, segments = [], [], []
    split = _split_scale(by_rank, chosen, window)
    for i, rank in enumerate(chosen):
        y = TOP + i * CELL_H
        recs = by_rank[rank]
        stage = next((r.stage for r in recs.values()), 0)
        worst = max((v for (rk, _), v in ratios.items() if rk == rank), default=None)
        node = attempt.rank_nodes.get(rank) or (known_nodes or {}).get(rank) or run.node_of(rank, attempt) or "?"
        rows.append(Row(rank, node, stage, y, rank in suspects, worst))
        for step in window:
            cells.append(_cell(x(step), y, step, recs.get(step), ratios.get((rank, step))))
        segments += _segments(recs, window, y, split)
    # Every fifth step labelled, and the anchor; NOTE: not a fifth step right beside the anchor (the labels overlap).
    columns = [(x(s) + cell_w / 2, s) for s in window
               if s == anchor or ((s - window[0]) % 5 == 0 and abs(s - anchor) > 2)]
    return HeatMap(width=LABEL_W + cell_w * len(window) + 10, height=TOP + CELL_H * len(chosen) + 6, cell_w=cell_w,
                   cell_h=CELL_H, label_w=LABEL_W, rows=rows, cells=cells, columns=columns,
                   marker_x=x(anchor) + cell_w if anchor in window else None, attempt=attempt.number,
                   ranks_total=len(by_rank), split_width=LABEL_W + 330, segments=segments,
                   phases=[(p, PHASE_COLOURS.get(p, "#969696")) for p in _phases(by_rank, chosen, window)])


def _ratios(by_rank: dict[int, dict[int, StepRecord]], window: list[int]) -> dict[tuple[int, int], float]:
    """(rank, step) -> compute time over the fastest of the same pipeline stage at that step."""
    out = {}
    for step in window:
        present = [(rank, recs[step]) for rank, recs in by_rank.items() if step in recs]
        fastest: dict[int, float] = {}
        for _, r in present:
            fastest[r.stage] = min(fastest.get(r.stage, float("inf")), compute_s(r))
        for rank, r in present:
            base = fastest[r.stage]
            out[(rank, step)] = compute_s(r) / base if base > 0 else 1.0
    return out


def _choose(by_rank: dict[int, dict[int, StepRecord]], ratios: dict[tuple[int, int], float],
            suspects: list[int]) -> list[int]:
    if len(by_rank) <= MAX_ROWS:
        return sorted(by_rank)
    worst: dict[int, float] = {}
    for (rank, _), v in ratios.items():
        worst[rank] = max(worst.get(rank, 0.0), v)
    # NOTE: a rank with no record in the window at all (silent from the start) sorts first after the suspects.
    order = sorted(by_rank, key=lambda r: (r not in suspects, -worst.get(r, float("inf")), r))
    return sorted(order[:MAX_ROWS])


def _cell(x: float, y: float, step: int, r: StepRecord | None, ratio: float | None) -> Cell:
    if r is None or ratio is None:
        return Cell(x, y, MISSING, None, f"step {step}: no record from this rank")
    phases = ", ".join(f"{p} {r.phases[p]:.3f} s" for p in ordered_phases(r.phases))
    return Cell(x, y, colour(ratio), round(ratio, 3),
                f"step {step}: compute {compute_s(r):.3f} s ({ratio:.2f}x the fastest of stage {r.stage}); "
                f"step {r.step_seconds:.3f} s; {phases}")


def _phases(by_rank: dict[int, dict[int, StepRecord]], chosen: list[int], window: list[int]) -> list[str]:
    seen: dict[str, float] = {}
    for rank in chosen:
        for step in window:
            r = by_rank[rank].get(step)
            if r is not None:
                seen.update(dict.fromkeys(r.phases, 0.0))
    return ordered_phases(seen)


def _medians(recs: dict[int, StepRecord], window: list[int]) -> dict[str, float]:
    present = [recs[s] for s in window if s in recs]
    return {p: statistics.median(r.phases.get(p, 0.0) for r in present)
            for p in ordered_phases({k: 0.0 for r in present for k in r.phases})} if present else {}


def _split_scale(by_rank: dict[int, dict[int, StepRecord]], chosen: list[int], window: list[int]) -> Scale:
    top = max((sum(_medians(by_rank[r], window).values()) for r in chosen), default=0.0)
    return Scale(0.0, top or 1.0, LABEL_W, LABEL_W + 320)


def _segments(recs: dict[int, StepRecord], window: list[int], y: float, x: Scale) -> list[Segment]:
    out, total = [], 0.0
    for phase, seconds in _medians(recs, window).items():
        if seconds <= 0:
            continue
        out.append(Segment(x(total), y, round(x(total + seconds) - x(total), 2), PHASE_COLOURS.get(phase, "#969696"),
                           f"{phase}: {seconds:.3f} s (median over the window)"))
        total += seconds
    return out
