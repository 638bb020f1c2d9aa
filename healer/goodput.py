"""The goodput ledger of a supervised run: where its wall time went, read back from what the run left on disk.

    <run_dir>/supervisor/attempts.jsonl   when each attempt started and ended (the supervisor)
    <run_dir>/incidents.jsonl             each incident: detected, decided, restarted, recovered (the loop)
    <run_dir>/ranks/0.jsonl               rank 0's step records, every attempt appended (the trainer)

Wall time (first start to last end) is split into:
- productive: the steps that count (the last run of each step index), less their checkpoint stall;
- checkpointing: the checkpoint phase of those steps (the blocking part of each save);
- lost work: steps that were run and then run again after a restart from an older checkpoint;
- detection: from the last step a failed attempt finished to the incident's detection;
- diagnosis: detection to decision (runbooks);
- restart: decision to the next attempt's start (stopping the old attempt, waiting out backoff);
- startup: an attempt's start to the start of its first step (imports, rendezvous, checkpoint load);
- other: what is left (the final save and teardown, gaps between steps).
ETTR (effective training time ratio) = productive / wall.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from healer.jsonl import read_jsonl

CATEGORIES = ("productive", "checkpointing", "lost_work", "detection", "diagnosis", "restart", "startup", "other")


@dataclass(slots=True)
class Ledger:
    wall_s: float
    seconds: dict[str, float]
    ettr: float
    steps_done: int
    lost_steps: int
    attempts: int
    incidents: list[dict[str, Any]] = field(default_factory=list)

    def to_payload(self) -> dict[str, Any]:
        return asdict(self)


def incidents(run_dir: Path) -> list[dict[str, Any]]:
    """The latest state of each incident, with its stage times."""
    latest: dict[int, dict[str, Any]] = {}
    decided: dict[int, float] = {}
    for entry in read_jsonl(run_dir / "incidents.jsonl"):
        inc = entry["incident"]
        latest[inc["id"]] = inc
        if entry["event"] == "decided":
            decided[inc["id"]] = entry["at"]
    out = []
    for inc in latest.values():
        inc["decided_at"] = decided.get(inc["id"])
        out.append(inc)
    return sorted(out, key=lambda i: i["id"])


def compute(run_dir: Path) -> Ledger:
    """Pure over the files: the ledger of `run_dir`. ValueError when the run has no supervisor journal."""
    attempts = read_jsonl(run_dir / "supervisor" / "attempts.jsonl")
    starts = {a["attempt"]: a["at"] for a in attempts if a["event"] == "start"}
    ends = {a["attempt"]: a["at"] for a in attempts if a["event"] == "end"}
    if not starts:
        raise ValueError(f"{run_dir}: no supervisor/attempts.jsonl: not a supervised run")
    records = [r for r in read_jsonl(run_dir / "ranks" / "0.jsonl") if "step" in r and "time" in r]
    t0 = min(starts.values())
    t1 = max([*ends.values(), *(r["time"] for r in records)], default=t0)
    # Assign each record to its attempt by time; the last run of each step index is the one that counts.
    final: dict[int, dict[str, Any]] = {}
    lost = 0.0
    lost_steps = 0
    first_step_start: dict[int, float] = {}
    order = sorted(starts.items(), key=lambda kv: kv[1])
    for r in sorted(records, key=lambda r: r["time"]):
        begun = r["time"] - r["step_seconds"]
        attempt = max((n for n, at in order if at <= begun), default=order[0][0])
        first_step_start.setdefault(attempt, begun)
        if r["step"] in final:
            lost += final[r["step"]]["step_seconds"]
            lost_steps += 1
        final[r["step"]] = r
    ckpt = sum(r.get("phases", {}).get("checkpoint", 0.0) for r in final.values())
    productive = sum(r["step_seconds"] for r in final.values()) - ckpt
    startup = sum(max(0.0, first_step_start[n] - at) for n, at in starts.items() if n in first_step_start)
    incs = incidents(run_dir)
    detection = diagnosis = restart = 0.0
    for inc in incs:
        last_progress = max((r["time"] for r in records if starts.get(inc["attempt"], t0) <= r["time"] - r["step_seconds"]
                             and r["time"] <= inc["detected_at"]), default=starts.get(inc["attempt"], t0))
        inc["detected_in_s"] = max(0.0, inc["detected_at"] - last_progress)
        detection += inc["detected_in_s"]
        if inc.get("decided_at") is not None:
            inc["diagnosed_in_s"] = max(0.0, inc["decided_at"] - inc["detected_at"])
            diagnosis += inc["diagnosed_in_s"]
            if inc.get("remediated_at") is not None:
                restart += max(0.0, inc["remediated_at"] - inc["decided_at"])
        if inc.get("recovered_at") is not None:
            inc["recovered_in_s"] = inc["recovered_at"] - last_progress
    wall = max(0.0, t1 - t0)
    seconds = {"productive": productive, "checkpointing": ckpt, "lost_work": lost, "detection": detection,
               "diagnosis": diagnosis, "restart": restart, "startup": startup}
    seconds["other"] = max(0.0, wall - sum(seconds.values()))
    return Ledger(wall_s=wall, seconds={k: round(v, 3) for k, v in seconds.items()},
                  ettr=round(productive / wall, 4) if wall > 0 else 0.0, steps_done=len(final), lost_steps=lost_steps,
                  attempts=len(starts), incidents=incs)
