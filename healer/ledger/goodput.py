"""The goodput ledger of a supervised run: where its wall time went, from what the run left on disk and the
incidents the healer stored.

    <run_dir>/launcher/attempts.jsonl     when each attempt started and ended (wire/journal.py)
    <run_dir>/ranks/0.jsonl               rank 0's step records, every attempt appended (the trainer)
    incidents (healer.incidents.timeline)      each incident's stage times: detected, decided, restarted, recovered

Wall time (first start to the last thing the run wrote) is cut into intervals that do not overlap, of kinds:
- productive: the steps that count (the last run of each step index), less their checkpoint stall;
- checkpointing: the checkpoint phase of those steps (the blocking part of each save);
- lost (lost work): steps that were run and then run again after a restart from an older checkpoint;
- detection: from the last step a failed attempt finished to the incident's detection;
- diagnosis: detection to decision (runbooks);
- restart: decision to the next attempt's start (stopping the old attempt, waiting out backoff);
- startup: an attempt's start to the start of its first step (imports, rendezvous, checkpoint load);
- other: what is left (the final save and teardown, gaps between steps).
Where two of these claim the same time (an incident that did not stop the job is detected while a step runs),
the time goes to the first of: steps, startup, then the incidents' stages in incident order. The totals of
`compute` are the sums of the intervals, so they add up to the wall time. ETTR (here) = productive / wall.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ground.jsonl import read_jsonl
from wire.journal import Journal
from wire.run_paths import RunPaths

CATEGORIES = ("productive", "checkpointing", "lost_work", "detection", "diagnosis", "restart", "startup", "other")
KINDS = ("productive", "checkpointing", "lost", "detection", "diagnosis", "restart", "startup", "other")
"""Interval kinds, as the goodput_intervals table and the dashboards name them (CATEGORIES, in that order)."""
MIN_CHECKPOINT_STALL_S = 0.01
"""A step's checkpoint phase shorter than this stays in its productive interval. NOTE: the trainer times the
checkpoint phase on every step; on the steps that do not save it is microseconds, and one interval each would
make a row per step."""
STEP_GAP_S = 0.1
"""A gap shorter than this between two steps (the trainer's per-step bookkeeping) belongs to the next step, so
a stretch of steps is one interval; a longer one (an evaluation, a pause) is `other`."""


@dataclass(frozen=True, slots=True)
class Interval:
    kind: str
    start: float
    end: float
    incident: int | None = None
    """The loop incident whose stage this is (detection, diagnosis, restart) or whose restart made the work lost."""
    steps: int | None = None
    """Steps run in it (productive, lost)."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class Ledger:
    wall_s: float
    seconds: dict[str, float]
    ettr: float
    steps_done: int
    lost_steps: int
    attempts: int
    incidents: list[dict[str, Any]] = field(default_factory=list)
    degraded_s: float = 0.0
    """Of `productive`, the steps trained with fewer ranks than the run's most: a job that came back smaller (a host
    left out with no spare) until it grew back, or a job of replica groups training on without a lost group until
    its replacement joined (the job never stopped: this time is not lost, it is trained at a smaller scale)."""

    def to_payload(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Run:
    starts: dict[int, float]
    ends: dict[int, float]
    records: list[dict[str, Any]]
    """Rank 0's step records in time order, each with the attempt it ran in (`_attempt`)."""
    incidents: list[dict[str, Any]]
    times: list[float] = field(default_factory=list)
    """records' end times, for bisect."""


def intervals(run_dir: Path, incidents: list[dict[str, Any]]) -> list[Interval]:
    """Pure over the files and `incidents` (healer.incidents.timeline payloads): the run's intervals in time order, from
    the first start to the end of the wall time, neither overlapping nor leaving gaps, a stretch of one kind (and
    incident) in one; [] before the first start."""
    run = _read(run_dir, incidents)
    return _split(run)[0] if run.starts else []


def compute(run_dir: Path, incidents: list[dict[str, Any]]) -> Ledger:
    """Pure over the files and `incidents`: the ledger of `run_dir`. ValueError when the run has no attempts'
    journal."""
    run = _read(run_dir, incidents)
    if not run.starts:
        raise ValueError(f"{run_dir}: no attempts' journal (launcher/attempts.jsonl): not a supervised run")
    spans, final, lost_steps = _split(run)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for span in spans:
        seconds[CATEGORIES[KINDS.index(span.kind)]] += span.seconds
    wall = spans[-1].end - spans[0].start if spans else 0.0
    return Ledger(wall_s=wall, seconds={k: round(v, 3) for k, v in seconds.items()},
                  ettr=round(seconds["productive"] / wall, 4) if wall > 0 else 0.0, steps_done=final,
                  lost_steps=lost_steps, attempts=len(run.starts), incidents=run.incidents,
                  degraded_s=round(_degraded(run.records), 3))


def _degraded(records: list[dict[str, Any]]) -> float:
    """The seconds of the steps that count trained at fewer ranks than the run's most: a job that came back smaller,
    or one of replica groups (train/ft/) stepping on with fewer groups while a lost one is replaced (each record's
    ranks: its group's world size x the groups that took part)."""
    def ranks(r: dict[str, Any]) -> int:
        return int(r.get("world_size") or 1) * int(r.get("replicas") or 1)

    full = max((ranks(r) for r in records), default=1)
    final = {r["step"]: r for r in records}
    return sum(r.get("step_seconds", 0.0) for r in final.values() if ranks(r) < full)


# ---- reading and splitting -----------------------------------------------------------------------------------

def _read(run_dir: Path, incidents: list[dict[str, Any]]) -> _Run:
    paths = RunPaths(run_dir)
    past = Journal.of(paths.journal)
    starts = {s.attempt: s.at for s in past.starts}
    ends = {e.attempt: e.at for e in past.ends}
    records = sorted((r for r in read_jsonl(paths.rank_records(0)) if "step" in r and "time" in r),
                     key=lambda r: r["time"])
    order = sorted(starts.items(), key=lambda kv: kv[1])
    for r in records:  # each record's attempt: the last one started when its step began (else the first)
        i = bisect.bisect_right(order, r["time"] - r["step_seconds"], key=lambda kv: kv[1])
        r["_attempt"] = order[max(i - 1, 0)][0] if order else 0
    return _Run(starts, ends, records, [dict(i) for i in sorted(incidents, key=lambda i: i["id"])],
                [r["time"] for r in records])


def _split(run: _Run) -> tuple[list[Interval], int, int]:
    """(intervals, steps that count, steps lost); annotates run.incidents with their stage times."""
    t0 = min(run.starts.values())
    t1 = max([*run.starts.values(), *run.ends.values(), *(r["time"] for r in run.records),
              *_stage_times(run.incidents)])
    steps, final, lost_steps = _step_pieces(run, t0)
    first_step: dict[int, float] = {}
    for r in run.records:
        first_step.setdefault(r["_attempt"], r["time"] - r["step_seconds"])
    claims = [Interval("startup", at, first_step[n]) for n, at in sorted(run.starts.items()) if n in first_step]
    for inc in run.incidents:
        claims += _stages(inc, run, t0)
    return _merge(_paint(t0, t1, steps, claims)), final, lost_steps


def _step_pieces(run: _Run, t0: float) -> tuple[list[Interval], int, int]:
    """The steps' stretches (productive, lost, checkpointing), disjoint, in time order; and the step counts."""
    final = {r["step"]: i for i, r in enumerate(run.records)}  # the last run of each step index counts
    restarted_by: dict[int, int] = {}  # attempt -> the (newest) incident in it whose restart made its redone steps lost
    for inc in run.incidents:
        if inc.get("remediated_at") is not None:
            restarted_by[inc["attempt"]] = inc["id"]
    pieces: list[Interval] = []

    def add(kind: str, start: float, end: float, incident: int | None = None, steps: int | None = None) -> None:
        last = pieces[-1] if pieces else None
        if last is not None and (last.kind, last.incident, last.end) == (kind, incident, start):
            pieces[-1] = Interval(kind, last.start, end, incident, None if steps is None else (last.steps or 0) + steps)
        else:
            pieces.append(Interval(kind, start, end, incident, steps))

    cursor = t0
    for i, r in enumerate(run.records):
        end, begin = r["time"], r["time"] - r["step_seconds"]
        begin = cursor if begin - cursor < STEP_GAP_S else begin  # NOTE: also clips an overlap (clock jitter)
        if end <= begin:
            continue
        if final[r["step"]] != i:
            add("lost", begin, end, restarted_by.get(r["_attempt"]), 1)
        else:
            stall = min(r.get("phases", {}).get("checkpoint", 0.0), end - begin)
            stall = stall if stall >= MIN_CHECKPOINT_STALL_S else 0.0
            add("productive", begin, end - stall, None, 1)
            if stall:
                add("checkpointing", end - stall, end)
        cursor = end
    return pieces, len(final), len(run.records) - len(final)


def _stages(inc: dict[str, Any], run: _Run, t0: float) -> list[Interval]:
    """The incident's detection, diagnosis and restart (as claims); notes their lengths in `inc`."""
    started = last_progress = run.starts.get(inc["attempt"], t0)
    # The last step the attempt finished by the detection: walk back from it to the attempt's start.
    for i in range(bisect.bisect_right(run.times, inc["detected_at"]) - 1, -1, -1):
        r = run.records[i]
        if r["time"] < started:
            break
        if r["time"] - r["step_seconds"] >= started:
            last_progress = r["time"]
            break
    detected, decided, remediated = inc["detected_at"], inc.get("decided_at"), inc.get("remediated_at")
    inc["detected_in_s"] = max(0.0, detected - last_progress)
    out = [Interval("detection", last_progress, detected, inc["id"])]
    if decided is not None:
        inc["diagnosed_in_s"] = max(0.0, decided - detected)
        out.append(Interval("diagnosis", detected, decided, inc["id"]))
        if remediated is not None:
            out.append(Interval("restart", decided, remediated, inc["id"]))
    if inc.get("recovered_at") is not None:
        inc["recovered_in_s"] = inc["recovered_at"] - last_progress
    return out


def _stage_times(incs: list[dict[str, Any]]) -> list[float]:
    """NOTE: they count towards the wall time: while an incident is diagnosed, they are the last thing written."""
    return [t for inc in incs for t in (inc["detected_at"], inc.get("decided_at"), inc.get("remediated_at"))
            if t is not None]


def _paint(t0: float, t1: float, steps: list[Interval], claims: list[Interval]) -> list[Interval]:
    """`steps` (disjoint, in time order) take their time first, then each claim in turn what is still free of its
    span; the time nobody claimed is `other`. The result covers [t0, t1] exactly."""
    free: list[tuple[float, float]] = []
    cursor = t0
    for piece in steps:
        if piece.start > cursor:
            free.append((cursor, min(piece.start, t1)))
        cursor = max(cursor, piece.end)
    if t1 > cursor:
        free.append((cursor, t1))
    out = list(steps)
    for claim in claims:
        start, end = max(claim.start, t0), min(claim.end, t1)
        if end <= start:
            continue
        i = j = bisect.bisect_right(free, start, key=lambda gap: gap[1])  # the first gap that ends after start
        kept: list[tuple[float, float]] = []
        while j < len(free) and free[j][0] < end:
            gap_start, gap_end = free[j]
            if gap_start < start:
                kept.append((gap_start, start))
            out.append(replace(claim, start=max(gap_start, start), end=min(gap_end, end)))
            if gap_end > end:
                kept.append((end, gap_end))
            j += 1
        free[i:j] = kept
    out += [Interval("other", a, b) for a, b in free]
    return sorted((s for s in out if s.end > s.start), key=lambda s: s.start)


def _merge(spans: list[Interval]) -> list[Interval]:
    """Neighbours of the same kind and incident made one (they touch: `_paint` leaves no gaps)."""
    out: list[Interval] = []
    for span in spans:
        prev = out[-1] if out else None
        if prev is not None and (prev.kind, prev.incident) == (span.kind, span.incident):
            steps = None if prev.steps is None and span.steps is None else (prev.steps or 0) + (span.steps or 0)
            out[-1] = replace(prev, end=span.end, steps=steps)
        else:
            out.append(span)
    return out
