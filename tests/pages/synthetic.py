"""A small run directory and healer database written by hand (no training): 4 ranks in two pipeline stages on two
hosts, rank 2 computing three times slower from step 5, an incident naming it, and one with hostile labels. For the
page tests that need no real run; the browser tests use a real one (test_browser.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from healer.decide.signals import Signal
from healer.detect.suspects import Suspect
from healer.incidents.db import ensure_schema, make_engine
from healer.incidents.store import IncidentStore

JOB = "synth"
T0 = 1_800_000_000.0
HOSTILE = "<script>alert(1)</script>"
SLOW_RANK, STEPS = 2, 20
STEP_S, SLOWED_S = 0.9, 0.05
"""Every rank's step before rank 2 slows down, and what each step takes longer from step 5."""


def write_run(root: Path) -> Path:
    run = root / JOB
    (run / "supervisor").mkdir(parents=True)
    (run / "ranks").mkdir()
    journal = [{"event": "start", "job": JOB, "attempt": 0, "at": T0, "nodes": ["n1", "n2"], "dp": 2, "resume": "auto"},
               {"event": "ranks", "attempt": 0, "at": T0 + 2, "ranks": {str(100 + r): r for r in range(4)},
                "nodes": {str(r): "n1" if r < 2 else "n2" for r in range(4)}},
               {"event": "end", "attempt": 0, "at": T0 + 3 + STEPS, "exit_codes": {"n1": 0, "n2": 0}, "stopped": False}]
    (run / "supervisor" / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in journal))
    for rank in range(4):
        lines = []
        for step in range(STEPS):
            compute = 0.3 if rank == SLOW_RANK and step >= 5 else 0.1
            # Every rank's step grows by SLOWED_S while rank 2 computes slowly: the others wait for it.
            lines.append(json.dumps({
                "step": step, "time": T0 + 3 + step + 1, "loss": 5.0 - 0.1 * step,
                "step_seconds": STEP_S + (SLOWED_S if step >= 5 else 0.0),
                "phases": {"data_wait": 0.01, "forward_backward": compute, "dp_reduce": 0.8 - compute,
                           "optimizer": 0.0, "checkpoint": 0.0},
                "rank": rank, "node": "machine", "mesh": {"pp": rank // 2, "dp": rank % 2, "tp": 0}}))
        (run / "ranks" / f"{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return run


def write_incidents(db_url: str) -> tuple[int, int]:
    """(the straggler's id, the hostile incident's id)."""
    engine = make_engine(db_url)
    ensure_schema(engine)
    store = IncidentStore(engine, "test", clock=lambda: datetime.fromtimestamp(T0 + 15, UTC))
    straggler, _ = store.record(Signal(
        rule="straggler", kind="straggler", severity="warning", page="never", cooldown=timedelta(0),
        identity=(("job", JOB),), job=JOB, node="n2", summary=f"rank {SLOW_RANK} on n2 holds the job up (compute)",
        evidence={"suspect_rank": SLOW_RANK, "suspect_node": "n2", "cause": "compute", "windows": 2,
                  "window_steps": 3, "detail": {"compute_s": 0.3, "median_compute_s": 0.1, "ratio": 3.0},
                  "ranks_in_table": 4,
                  "phase_table": [{"rank": r, "node": "n1" if r < 2 else "n2", "stage": r // 2, "samples": 3,
                                   "step_s": 0.95, "compute_s": 0.3 if r == SLOW_RANK else 0.1, "data_wait_s": 0.01,
                                   "dp_reduce_s": 0.5 if r == SLOW_RANK else 0.7, "reduce_lag_s": None}
                                  for r in range(4)]}, attempt=0,
        suspects=(Suspect(node="n2", rank=SLOW_RANK),)))
    hostile, _ = store.record(Signal(
        rule=HOSTILE, kind="crash", severity="critical", page="always", cooldown=timedelta(0),
        identity=(("job", HOSTILE),), job=HOSTILE, node=f"n{HOSTILE}", summary=f"summary {HOSTILE}",
        evidence={"note": HOSTILE}, labels={"team": HOSTILE, HOSTILE: "key"}))
    engine.dispose()
    return straggler, hostile


def hang_ranks() -> list[dict[str, object]]:
    """What each of the 4 ranks was doing in a hang (healer/agent/rank_evidence.py's shape): rank 2 computing, its
    pipeline peer 0 waiting for it in a pipeline receive, 0's data-parallel peer 1 in the reduce, 2's (3) too."""
    def rank(r: int, phase: str, frame: str) -> dict[str, object]:
        return {"rank": r, "node": "n1" if r < 2 else "n2", "state": "S", "phase": {"phase": phase, "step": 7},
                "stack": [frame, "train/loop.py:200 step"]}
    return [rank(0, "forward_backward", "torch/distributed/pipelining/stage.py:510 recv"),
            rank(1, "dp_reduce", "torch/distributed/distributed_c10d.py:2800 all_reduce"),
            rank(2, "forward_backward", "train/model.py:88 forward"),
            rank(3, "dp_reduce", "torch/distributed/distributed_c10d.py:2800 all_reduce")]


MESH = {r: {"pp": r // 2, "dp": r % 2, "tp": 0} for r in range(4)}


def write_hang(db_url: str) -> int:
    """A hang of the job whose ranks were looked at: its stacks and the chain of waits in its evidence, as the
    responder writes them (healer/engine/respond.py)."""
    from healer.detect.hang_attribution import attribute

    engine = make_engine(db_url)
    ensure_schema(engine)
    store = IncidentStore(engine, "test", clock=lambda: datetime.fromtimestamp(T0 + 16, UTC))
    att = attribute(hang_ranks(), MESH)
    hang, _ = store.record(Signal(
        rule="hang", kind="hang", severity="critical", page="on-escalation", cooldown=timedelta(0),
        identity=(("job", JOB), ("kind", "hang")), job=JOB, node="n2", summary="no step progress for 30 s",
        evidence={"stacks": {"attempt": 0, "ranks": hang_ranks(), "unreached": {}, "attribution": att.to_payload(),
                             "took_s": 0.4}},
        attempt=0, suspects=tuple(Suspect(node="n2", rank=r) for r in att.suspects)))
    engine.dispose()
    return hang
