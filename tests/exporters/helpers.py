"""Step records shaped like the trainer's (train/trainer.py, Trainer._record), for tests that run no training."""

from __future__ import annotations

import time
from typing import Any

PHASES = {"data_wait": 0.0001, "dp_gather": 0.004, "forward_backward": 0.09, "pp_wait": 0.01, "dp_reduce": 0.05,
          "grad_norm_clip": 0.013, "optimizer": 0.005, "checkpoint": 0.002}


def step_record(step: int, rank: int = 0, world_size: int = 4, mesh: dict[str, int] | None = None,
                **overrides: Any) -> dict[str, Any]:
    phases = dict(PHASES)
    record = {
        "step": step, "time": time.time(), "loss": 5.5 - 0.01 * step, "grad_norm": 1.25, "lr": 1e-3,
        "tokens": 512, "step_seconds": sum(phases.values()), "tokens_per_second": 2870.0, "mfu": 0.0161,
        "peak_flops": 8.35e10, "peak_source": "probe:cpu-matmul-fp32", "phases": phases,
        "dp_reduce_enter_ns": 1_000_000_000 + rank * 1_000_000, "sample_index": 8 * (step + 1),
        "checkpoint_events": [],
        "max_rss_mib": 328.9, "rank": rank, "local_rank": rank, "world_size": world_size,
        "mesh": mesh if mesh is not None else {"pp": 0, "dp": rank, "tp": 0}, "node": "host-a", "pid": 4242,
    }
    record.update(overrides)
    return record
