"""What the flight recorder costs training, written as JSON: the node agent turns it on for every rank it starts
(TORCH_FR_BUFFER_SIZE, with the dump thread of train/flight_recorder.py), so it had better be cheap.

Run:  .venv/bin/python bench/flight_recorder_overhead.py [--pairs 3] [--steps 30] [--config demo]
      [--out bench/results/flight_recorder_overhead.json]

Jobs of 4 ranks on gloo under plain torchrun, the recorder off (buffer 0, no phase directory) and on (buffer 2000 and
a phase directory: every collective recorded, the dump thread polling), interleaved in pairs whose order flips
every pair so that drift cancels. Per pair, the ratio of the median step times after warm-up; reported: the median
ratio and the spread.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from train.records import read_records  # noqa: E402

WARMUP = 5


def run(config: str, steps: int, recorder: bool, scratch: Path) -> list[float]:
    run_dir = scratch / f"run-{time.monotonic_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               TORCH_FR_BUFFER_SIZE="2000" if recorder else "0", TORCH_NCCL_TRACE_BUFFER_SIZE="0")
    env.pop("MEGAHEAL_PHASE_DIR", None)
    if recorder:
        env["MEGAHEAL_PHASE_DIR"] = str(run_dir / "phase")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "train",
            "--config", str(REPO / "configs" / f"{config}.yaml"), "--run-dir", str(run_dir),
            "--set", f"steps={steps}", "--set", f"log_every={steps}"]
    subprocess.run(argv, cwd=REPO, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
    records = read_records(run_dir / "ranks" / "0.jsonl")
    return [r["step_seconds"] for r in records if r["step"] >= WARMUP]


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
    ratios = [p["ratio"] for p in pairs]
    result = {
        "benchmark": "flight_recorder_overhead",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "config": args.config, "ranks": 4, "steps": args.steps, "warmup_steps": WARMUP, "pairs": pairs,
        "step_time_ratio_on_off": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "overhead_pct_median": round((statistics.median(ratios) - 1) * 100, 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["step_time_ratio_on_off"]), f"-> {args.out}")


if __name__ == "__main__":
    main()
