"""Linear scales and round tick values for the SVG charts (the charts are drawn on the server, so this is all the
charting library there is)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Scale:
    """Maps [lo, hi] of the data onto [a, b] of the drawing (b < a for a y axis, which grows downwards)."""

    lo: float
    hi: float
    a: float
    b: float

    def __call__(self, value: float) -> float:
        span = self.hi - self.lo
        t = (value - self.lo) / span if span else 0.5
        return round(self.a + t * (self.b - self.a), 2)


def ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    out = []
    value = first
    while value <= hi + step * 1e-9:
        out.append(round(value, 10))
        value += step
    return out


def label(value: float) -> str:
    """A tick's text: no trailing zeros, thousands as k."""
    if abs(value) >= 10000:
        return f"{value / 1000:g}k"
    return f"{value:g}" if abs(value) >= 0.01 or value == 0 else f"{value:.1e}"


def duration(seconds: float | None) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min: the unit a person reads at a glance."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


CHAR_W = 6.4
"""Width of a character of the charts' 11 px sans-serif, a little over its average (digits and lower case), so that an
estimate errs towards a gap."""


LABEL_ROW_H = 14
"""Between two rows of labels: Chromium boxes an 11 px line of text 13 px high, so rows 12 apart overlapped."""


def label_width(text: str) -> float:
    return round(len(text) * CHAR_W + 4, 1)


def place_labels(labels: list[tuple[float, str]], rows: int, gap: float = 4.0) -> list[int | None]:
    """For each (x, text) label drawn from x to the right: the row (0 .. rows-1) it goes in so that no two labels of
    a row overlap, or None where every row is taken there (the caller draws its mark without the text, which its
    <title> still gives). Greedy in order of x: the first row that is free by then."""
    if rows < 1:
        raise ValueError(f"place_labels: rows must be >= 1, got {rows}")
    ends = [float("-inf")] * rows
    out: list[int | None] = [None] * len(labels)
    for i in sorted(range(len(labels)), key=lambda i: labels[i][0]):
        x, text = labels[i]
        row = next((r for r in range(rows) if ends[r] + gap <= x), None)
        if row is not None:
            ends[row] = x + label_width(text)
            out[i] = row
    return out
