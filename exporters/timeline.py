"""A Chrome/Perfetto trace of all ranks from a run directory's JSON lines: who holds everyone up.

    megaheal timeline RUNS/DIR -o trace.json     # open in https://ui.perfetto.dev or chrome://tracing

One track per rank, ordered by its (pp, dp, tp) coordinates and grouped by pipeline stage; on each
track a slice per step with its phases nested inside, laid end to end in the order the trainer runs
them. Times are the ranks' wall clocks (the record's `time` ends the step), so across nodes the
view is as good as the nodes' clock sync. Loss and MFU of the lowest rank are counter tracks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wire.run_paths import RunPaths
from wire.telemetry import ordered_phases


@dataclass(frozen=True, slots=True)
class RankRecords:
    rank: int
    coords: tuple[int, int, int]
    records: list[dict[str, Any]]


def read_rank_files(run_dir: Path) -> tuple[list[RankRecords], int]:
    """Every rank's step records, ordered by (pp, dp, tp, rank); also how many unreadable lines were skipped.

    NOTE: a rank killed mid-write leaves a torn last line; the timeline skips such lines instead of failing,
    since a crashed run is exactly when one wants to look at it.
    """
    ranks, skipped = [], 0
    for path in sorted(RunPaths(run_dir).ranks.glob("*.jsonl")):
        records = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped += bool(line.strip())
                continue
            if isinstance(record, dict) and {"step", "time", "step_seconds", "phases"} <= record.keys():
                records.append(record)
            else:
                skipped += 1
        if not path.stem.isdigit() or not records:
            continue
        mesh = records[-1].get("mesh") or {}
        coords = (int(mesh.get("pp", 0)), int(mesh.get("dp", 0)), int(mesh.get("tp", 0)))
        ranks.append(RankRecords(rank=int(path.stem), coords=coords, records=records))
    ranks.sort(key=lambda r: (*r.coords, r.rank))
    return ranks, skipped


def build_trace(ranks: list[RankRecords], first_step: int = 0, last_step: int | None = None) -> dict[str, Any]:
    """The Chrome trace-event JSON object for the given ranks and step range (inclusive)."""
    def wanted(rec: dict[str, Any]) -> bool:
        return rec["step"] >= first_step and (last_step is None or rec["step"] <= last_step)

    starts = [rec["time"] - rec["step_seconds"] for r in ranks for rec in r.records if wanted(rec)]
    if not starts:
        raise ValueError("no step records in the requested range")
    origin = min(starts)
    events: list[dict[str, Any]] = []
    for order, r in enumerate(ranks):
        pid, tid = r.coords[0] + 1, r.rank  # one process per pipeline stage, one thread (track) per rank
        events += _track_metadata(pid, tid, order, r)
        for rec in filter(wanted, r.records):
            events += _step_events(rec, pid, tid, origin)
    events += _counters(ranks[0], wanted, origin) if ranks else []
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin_unix_s": origin, "ranks": len(ranks), "generator": "megaheal timeline"}}


def write_timeline(run_dir: Path, out: Path, first_step: int = 0, last_step: int | None = None) -> dict[str, int]:
    """Write the trace of `run_dir` to `out`; returns counts for the caller to report."""
    ranks, skipped = read_rank_files(run_dir)
    if not ranks:
        raise FileNotFoundError(f"{run_dir}/ranks/*.jsonl: no step records")
    trace = build_trace(ranks, first_step, last_step)
    out.write_text(json.dumps(trace, separators=(",", ":"), allow_nan=False))
    return {"ranks": len(ranks), "events": len(trace["traceEvents"]), "skipped_lines": skipped}


def _json_number(value: Any) -> Any:
    """NaN and infinities as strings: the trace format is strict JSON, and a NaN loss must still show."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _track_metadata(pid: int, tid: int, order: int, r: RankRecords) -> list[dict[str, Any]]:
    pp, dp, tp = r.coords
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"pipeline stage pp={pp}"}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
         "args": {"name": f"rank {r.rank} (pp {pp} dp {dp} tp {tp})"}},
        {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": order}},
    ]


def _step_events(rec: dict[str, Any], pid: int, tid: int, origin: float) -> list[dict[str, Any]]:
    start = rec["time"] - rec["step_seconds"] - origin
    args = {k: _json_number(rec[k]) for k in ("step", "loss", "grad_norm", "mfu", "tokens_per_second") if k in rec}
    events = [{"name": f"step {rec['step']}", "cat": "step", "ph": "X", "ts": _us(start),
               "dur": _us(rec["step_seconds"]), "pid": pid, "tid": tid, "args": args}]
    t = start
    for phase in ordered_phases(rec["phases"]):
        seconds = rec["phases"][phase]
        events.append({"name": phase, "cat": "phase", "ph": "X", "ts": _us(t), "dur": _us(seconds),
                       "pid": pid, "tid": tid, "args": {"step": rec["step"]}})
        t += seconds
    return events


def _counters(first: RankRecords, wanted: Any, origin: float) -> list[dict[str, Any]]:
    return [{"name": name, "ph": "C", "pid": 0, "tid": 0, "ts": _us(rec["time"] - origin), "args": {name: rec[name]}}
            for rec in filter(wanted, first.records) for name in ("loss", "mfu")
            if isinstance(rec.get(name), (int, float)) and math.isfinite(rec[name])]
