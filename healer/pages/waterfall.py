"""The goodput waterfall of a job (where its wall time went, category by category, each bar starting where the
previous one ended so that they add up to the wall time) and its time line (the same intervals in time order,
with the incidents marked). Geometry only: charts.html draws it."""

from __future__ import annotations

from dataclasses import dataclass

from healer.ledger.goodput import CATEGORIES, KINDS, Interval
from healer.pages.axes import Scale, label, place_labels, ticks

COLOURS = {"productive": "#1a9850", "checkpointing": "#91cf60", "lost_work": "#d73027", "detection": "#fc8d59",
           "diagnosis": "#fee08b", "restart": "#4575b4", "startup": "#91bfdb", "other": "#bdbdbd"}
NAMES = {"productive": "productive", "checkpointing": "checkpointing", "lost_work": "lost work",
         "detection": "detection", "diagnosis": "diagnosis", "restart": "restart", "startup": "startup",
         "other": "other"}
LEFT, WIDTH, BAR_H = 120, 620, 20
STRIP_ROWS = 2
"""Rows of incident labels above the time strip."""


@dataclass(frozen=True, slots=True)
class Bar:
    category: str
    name: str
    x: float
    w: float
    y: float
    fill: str
    seconds: float
    share: float


@dataclass(frozen=True, slots=True)
class Waterfall:
    width: float
    height: float
    bars: list[Bar]
    wall_s: float
    axis: list[tuple[float, str]]


@dataclass(frozen=True, slots=True)
class Span:
    x: float
    w: float
    fill: str
    title: str
    incident: int | None


@dataclass(frozen=True, slots=True)
class Marker:
    x: float
    incident: int
    text: str
    row: int | None = None
    """The label's row (healer.pages.axes.place_labels); None: no room for its text, the mark's <title> says it."""


def markers(found: list[tuple[float, int, str]], rows: int) -> list[Marker]:
    """(x, incident, text) as Markers whose labels do not overlap: each in the first row free at its x."""
    placed = place_labels([(x, text) for x, _, text in found], rows)
    return [Marker(x, i, text, row) for (x, i, text), row in zip(found, placed, strict=True)]


@dataclass(frozen=True, slots=True)
class Strip:
    width: float
    height: float
    spans: list[Span]
    markers: list[Marker]
    axis: list[tuple[float, str]]


def waterfall(seconds: dict[str, float], wall_s: float) -> Waterfall:
    x = Scale(0.0, wall_s or 1.0, LEFT, LEFT + WIDTH)
    bars, start = [], 0.0
    for i, category in enumerate(CATEGORIES):
        value = seconds.get(category, 0.0)
        bars.append(Bar(category, NAMES[category], x(start), max(round(x(start + value) - x(start), 2), 0.0),
                        10 + i * (BAR_H + 4), COLOURS[category], value, value / wall_s if wall_s else 0.0))
        start += value
    height = 10 + len(CATEGORIES) * (BAR_H + 4) + 24
    return Waterfall(LEFT + WIDTH + 190, height, bars, wall_s, _axis(x, wall_s))


def strip(spans: list[Interval], incidents: list[tuple[int, str, float]]) -> Strip | None:
    """The intervals in time order; `incidents`: (id, kind, detected_at) marked above them. None when empty."""
    if not spans:
        return None
    t0, t1 = spans[0].start, spans[-1].end
    x = Scale(0.0, (t1 - t0) or 1.0, LEFT, LEFT + WIDTH)
    out = []
    for s in spans:
        category = CATEGORIES[KINDS.index(s.kind)] if s.kind in KINDS else "other"
        title = f"{NAMES[category]}: {s.seconds:.1f} s from +{s.start - t0:.1f} s"
        if s.incident is not None:
            title += f" (incident {s.incident})"
        if s.steps:
            title += f", {s.steps} step(s)"
        out.append(Span(x(s.start - t0), max(round(x(s.end - t0) - x(s.start - t0), 2), 0.3), COLOURS[category],
                        title, s.incident))
    marks = markers([(x(at - t0), i, f"#{i} {kind}") for i, kind, at in incidents if t0 <= at <= t1], STRIP_ROWS)
    return Strip(LEFT + WIDTH + 190, 84, out, marks, _axis(x, t1 - t0))


def _axis(x: Scale, wall_s: float) -> list[tuple[float, str]]:
    return [(x(t), f"{label(t)} s") for t in ticks(0.0, wall_s, 6)]
