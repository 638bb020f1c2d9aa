"""The detectors' evidence drawn instead of shown as JSON: a hang's stack groups (which ranks share which innermost
frame, phase and kernel state) and its chain of waits (who waits for whom, healer/detect/hang_attribution.py), and a
straggler's phase table with the phase that grew (healer/detect/straggler.py). Geometry and rows only: the
_evidence.html template draws them.

The chain of waits is drawn with the ranks that wait alike (the same collective, held up by the same ranks) in one
box, so a job of thousands of ranks waiting in the same reduce is one box, not thousands; the boxes stand in
columns by how many waits they are from the rank that holds everyone up (rightmost), arrows pointing at whom they
wait for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BOX_W, BOX_H, COL_GAP, ROW_GAP, TOP = 200, 40, 70, 14, 8
MAX_BOXES = 40
"""Boxes drawn at most; the others are counted under the drawing."""
GREW = {"compute": ("compute_s", "compute"), "data": ("data_wait_s", "data wait"),
        "late-reduce": ("dp_reduce_s", "data-parallel reduce (the shortest: it arrives last)")}
"""Per straggler cause, the phase-table column that singled the rank out, and its name."""
PHASES = (("step_s", "step"), ("compute_s", "compute"), ("data_wait_s", "data wait"), ("dp_reduce_s", "dp reduce"),
          ("reduce_lag_s", "reduce lag"))


def _ranks_text(ranks: list[int]) -> str:
    """1, 2, 3, 7 -> '1-3, 7'."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1].isdigit() and int(out[-1].split("-")[-1]) == r - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


@dataclass(frozen=True, slots=True)
class Box:
    x: float
    y: float
    text: str
    """rank(s)"""
    what: str
    """What they wait in, or 'not in a collective'."""
    culprit: bool


@dataclass(frozen=True, slots=True)
class Arrow:
    x1: float
    y1: float
    x2: float
    y2: float


@dataclass(frozen=True, slots=True)
class WaitChain:
    width: float
    height: float
    boxes: list[Box]
    arrows: list[Arrow]
    box_w: float
    box_h: float
    left_out: int
    """Boxes not drawn (past MAX_BOXES)."""
    sentences: list[str]
    """The chain in words, from the longest wait to the culprit."""


@dataclass(frozen=True, slots=True)
class HangEvidence:
    how: str
    suspects: list[int]
    ambiguous: bool
    groups: list[dict[str, Any]]
    """Stack groups, largest first: phase, state, frame, ranks (as text), size, suspect."""
    chain: WaitChain | None
    unreached: dict[str, Any]


def hang_evidence(evidence: dict[str, Any]) -> HangEvidence | None:
    """From an incident's evidence (its `stacks`, written by healer/engine/respond.py); None where the ranks were not
    looked at."""
    stacks = evidence.get("stacks")
    if not isinstance(stacks, dict) or not isinstance(stacks.get("attribution"), dict):
        return None
    att = stacks["attribution"]
    suspects = [r for r in att.get("suspect_ranks") or [] if isinstance(r, int)]
    groups = [{"phase": g.get("phase"), "state": g.get("state"), "frame": g.get("frame"),
               "ranks": _ranks_text([r for r in g.get("ranks") or [] if isinstance(r, int)]),
               "size": g.get("size"), "suspect": bool(set(g.get("ranks") or []) & set(suspects))}
              for g in att.get("groups") or [] if isinstance(g, dict)]
    waits = {int(r): w for r, w in (att.get("waits") or {}).items() if str(r).isdigit() and isinstance(w, dict)}
    return HangEvidence(str(att.get("how") or ""), suspects, bool(att.get("ambiguous")), groups,
                        wait_chain(waits, suspects) if waits else None, stacks.get("unreached") or {})


def wait_chain(waits: dict[int, dict[str, Any]], suspects: list[int]) -> WaitChain:
    """`waits`: rank -> {op, group, held_up_by}. Ranks alike are one box; each box's column is its distance (in
    waits) from a rank that waits for nobody."""
    alike: dict[tuple[Any, ...], list[int]] = {}
    for r, w in sorted(waits.items()):
        key = (w.get("op"), w.get("group"), tuple(sorted(w.get("held_up_by") or [])))
        alike.setdefault(key, []).append(r)
    keys = list(alike)
    box_of = {r: i for i, k in enumerate(keys) for r in alike[k]}
    edges = {i: sorted({box_of[h] for h in k[2] if h in box_of} - {i}) for i, k in enumerate(keys)}
    # Distance to an end (a box that waits for nobody): breadth first from the ends over the reversed edges.
    depth = {i: 0 for i, out in edges.items() if not out}
    frontier = list(depth)
    while frontier:
        nxt = []
        for i, out in edges.items():
            if i not in depth and any(o in frontier for o in out):
                depth[i] = depth[min(o for o in out if o in frontier)] + 1
                nxt.append(i)
        frontier = nxt
    deepest = max(depth.values(), default=0)
    for i in edges:  # a cycle never reaches an end: drawn left of everything else
        depth.setdefault(i, deepest + 1)
    columns = max(depth.values(), default=0) + 1
    drawn = sorted(edges, key=lambda i: (depth[i], alike[keys[i]][0]))[:MAX_BOXES]
    rows: dict[int, int] = {}
    place: dict[int, tuple[float, float]] = {}
    for i in drawn:
        col = columns - 1 - depth[i]
        row = rows.get(col, 0)
        rows[col] = row + 1
        place[i] = (8 + col * (BOX_W + COL_GAP), TOP + row * (BOX_H + ROW_GAP))
    boxes = []
    for i, (x, y) in place.items():
        op, group, _ = keys[i]
        ranks = alike[keys[i]]
        what = f"waits in {op}" + (f" ({group})" if group else "") if op else "not in a collective"
        boxes.append(Box(x, y, f"rank{'s' if len(ranks) > 1 else ''} {_ranks_text(ranks)}", what,
                         bool(set(ranks) & set(suspects))))
    arrows = [Arrow(place[i][0] + BOX_W, place[i][1] + BOX_H / 2, place[o][0], place[o][1] + BOX_H / 2)
              for i in place for o in edges[i] if o in place]
    height = TOP + max(rows.values(), default=1) * (BOX_H + ROW_GAP) + 4
    return WaitChain(8 + columns * (BOX_W + COL_GAP), height, boxes, arrows, BOX_W, BOX_H,
                     len(edges) - len(drawn), _chain_sentences(keys, alike, edges))


def _chain_sentences(keys: list[tuple[Any, ...]], alike: dict[tuple[Any, ...], list[int]],
                     edges: dict[int, list[int]]) -> list[str]:
    out = []
    for i, k in enumerate(keys[:12]):
        ranks = alike[k]
        who = f"rank{'s' if len(ranks) > 1 else ''} {_ranks_text(ranks)}"
        held = [r for o in edges[i] for r in alike[keys[o]]] or list(k[2])
        if k[0] is None:
            out.append(f"{who}: not in a collective" + (f", waiting for rank(s) {_ranks_text(held)}" if held else
                                                        ", waiting for nobody"))
        else:
            out.append(f"{who} wait{'s' if len(ranks) == 1 else ''} in {k[0]}" + (f" ({k[1]})" if k[1] else "")
                       + (f" for rank(s) {_ranks_text(held)}" if held else ", held up by no rank shown"))
    return out


# ---- a straggler's phase table ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PhaseRow:
    rank: int
    node: str
    stage: int
    cells: list[tuple[str, float | None, float]]
    """(column, seconds, bar width in px) per PHASES column."""
    suspect: bool


@dataclass(frozen=True, slots=True)
class PhaseEvidence:
    cause: str
    grew: str
    """The phase-table column that singled the rank out ('' where the cause names none)."""
    grew_name: str
    sentence: str
    columns: list[tuple[str, str]]
    rows: list[PhaseRow]
    shown_of: int
    """The ranks of the window (the table holds the most unusual of them)."""
    bar_w: float


def phase_evidence(evidence: dict[str, Any], suspects: list[int], bar_w: float = 90.0) -> PhaseEvidence | None:
    table = [r for r in evidence.get("phase_table") or [] if isinstance(r, dict) and isinstance(r.get("rank"), int)]
    if not table:
        return None
    cause = str(evidence.get("cause") or "")
    grew, grew_name = GREW.get(cause, ("", ""))
    top = {c: max((float(r[c]) for r in table if isinstance(r.get(c), (int, float))), default=0.0)
           for c, _ in PHASES}
    rows = []
    for r in sorted(table, key=lambda r: (r["rank"] not in suspects, r.get("stage", 0), r["rank"])):
        cells = []
        for c, _ in PHASES:
            v = r.get(c)
            value = float(v) if isinstance(v, (int, float)) else None
            cells.append((c, value, round(bar_w * value / top[c], 1) if value is not None and top[c] > 0 else 0.0))
        rows.append(PhaseRow(r["rank"], str(r.get("node", "-")), int(r.get("stage", 0) or 0), cells,
                             r["rank"] in suspects))
    return PhaseEvidence(cause, grew, grew_name, _phase_sentence(cause, evidence.get("detail") or {}, suspects,
                                                                 evidence),
                         list(PHASES), rows, int(evidence.get("ranks_in_table") or len(table)), bar_w)


def _phase_sentence(cause: str, d: dict[str, Any], suspects: list[int], evidence: dict[str, Any]) -> str:
    who = f"rank {suspects[0]}" if suspects else "the suspect rank"
    windows = evidence.get("windows")
    steps = evidence.get("window_steps")
    over = f" (median per step over the last window of {steps} steps; named {windows} windows in a row)" \
        if windows and steps else ""
    if cause == "compute" and {"compute_s", "median_compute_s"} <= d.keys():
        return (f"{who}'s compute grew: {d['compute_s']:.3g} s per step against {d['median_compute_s']:.3g} s for the "
                f"other ranks of its pipeline stage ({d.get('ratio', 0):.2g}x){over}.")
    if cause == "data" and {"data_wait_s", "median_data_wait_s"} <= d.keys():
        return (f"{who}'s data wait grew: {d['data_wait_s']:.3g} s per step against {d['median_data_wait_s']:.3g} s "
                f"for the others, in a step of {d.get('step_s', 0):.3g} s{over}.")
    if cause == "late-reduce" and "dp_reduce_s" in d:
        return (f"{who} arrives last in the data-parallel reduce: its reduce takes {d['dp_reduce_s']:.3g} s while "
                f"the others wait {d.get('median_dp_reduce_s', 0):.3g} s for it{over}.")
    if cause == "late-reduce" and "reduce_lag_s" in d:
        return f"{who} enters the data-parallel reduce {d['reduce_lag_s']:.3g} s after the others{over}."
    return f"{who} held the job up ({cause or 'cause not recorded'}){over}."

