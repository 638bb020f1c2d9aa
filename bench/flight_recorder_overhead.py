"""What the flight recorder costs training, written as JSON: the node agent turns it on for every rank it starts
(TORCH_FR_BUFFER_SIZE, with the dump thread of exporters/flight_recorder.py), so it had better be cheap.

Run:  .venv/bin/python bench/flight_recorder_overhead.py [--pairs 3] [--steps 30] [--config demo]
      [--out bench/results/flight_recorder_overhead.json]

Jobs of 4 ranks on gloo under plain torchrun, the recorder off (buffer 0, no phase directory) and on (buffer 2000 and
a phase directory: every collective recorded, the dump thread polling), interleaved in pairs whose order flips
every pair so that drift cancels. Per pair, the ratio of the median step times after warm-up; reported: the median
ratio and the spread. On a shared 2-core machine that spread is wider than the recorder's cost, so the cost of one
recorded collective is also measured directly: 2 ranks on gloo, 3000 all-reduces of 64 floats, recorder off and on,
alternating; reported: microseconds per collective.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from train.records import read_records  # noqa: E402

WARMUP = 5
COLLECTIVES = 3000


def run(config: str, steps: int, recorder: bool, scratch: Path) -> list[float]:
    run_dir = scratch / f"run-{time.monotonic_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCH_FR_BUFFER_SIZE="2000" if recorder else "0")
    env.pop("MEGAHEAL_PHASE_DIR", None)
    env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
    if recorder:
        env["MEGAHEAL_PHASE_DIR"] = str(run_dir / "phase")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "train",
            "--config", str(REPO / "configs" / f"{config}.yaml"), "--run-dir", str(run_dir),
            "--set", f"steps={steps}", "--set", f"log_every={steps}"]
    subprocess.run(argv, cwd=REPO, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
    records = read_records(run_dir / "ranks" / "0.jsonl")
    return [r["step_seconds"] for r in records if r["step"] >= WARMUP]


def _collective_cost(rank: int, port: int, recorder: bool, out: Any) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000" if recorder else "0"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(64)
    for _ in range(200):
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(COLLECTIVES):
        dist.all_reduce(t)
    took = time.perf_counter() - t0
    dist.destroy_process_group()
    if rank == 0:
        out.put(took / COLLECTIVES * 1e6)


def collective_cost_us(recorder: bool) -> float:
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_collective_cost, args=(r, port, recorder, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    value = float(out.get(timeout=300))
    for proc in procs:
        proc.join(60)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--config", default="demo")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "flight_recorder_overhead.json")
    args = ap.parse_args()
    load_start = os.getloadavg()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="mh-fr-bench-") as tmp:
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            medians = {on: statistics.median(run(args.config, args.steps, on, Path(tmp))) for on in order}
            pairs.append({"off_s": round(medians[False], 5), "on_s": round(medians[True], 5),
                          "ratio": round(medians[True] / medians[False], 4)})
            print(f"pair {i}: off {medians[False]:.4f} s, on {medians[True]:.4f} s", flush=True)
    costs: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(4):
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            costs["on" if on else "off"].append(round(collective_cost_us(on), 2))
    print(f"all-reduce of 64 floats, 2 ranks: {costs}", flush=True)
    ratios = [p["ratio"] for p in pairs]
    result = {
        "benchmark": "flight_recorder_overhead",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "config": args.config, "ranks": 4, "steps": args.steps, "warmup_steps": WARMUP, "pairs": pairs,
        "step_time_ratio_on_off": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "overhead_pct_median": round((statistics.median(ratios) - 1) * 100, 2),
        "collective_us": {"collectives": COLLECTIVES, "runs": costs,
                          "off_median": statistics.median(costs["off"]), "on_median": statistics.median(costs["on"]),
                          "recorded_cost_us": round(statistics.median(costs["on"]) - statistics.median(costs["off"]), 2)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["step_time_ratio_on_off"]), f"-> {args.out}")


if __name__ == "__main__":
    main()
