"""Training throughput of each tiny layout on this machine, written as JSON.

Run:  .venv/bin/python bench/train_throughput.py [--steps 12] [--warmup 3] [--out bench/results/train_throughput.json]

For each layout it runs a real torchrun job on gloo (one thread per rank), skips the warm-up
steps (process-group set-up, pipeline shape inference, first allocations), and reports the
median tokens/s, step time and MFU (with the peak's source), and every rank's peak RSS.
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

LAYOUTS = {"tiny-dp4": 4, "tiny-tp2pp2": 4, "tiny-3d": 8}


def run_layout(name: str, nproc: int, steps: int, run_dir: Path) -> tuple[dict[int, list[dict]], float]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "train", "--config", str(REPO / "configs" / f"{name}.yaml"), "--run-dir", str(run_dir),
            "--set", f"steps={steps}", "--set", f"log_every={steps}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return {int(p.stem): read_records(p) for p in (run_dir / "ranks").glob("*.jsonl")}, wall


def summarise(records: dict[int, list[dict]], warmup: int, wall: float) -> dict:
    steady = records[0][warmup:]
    return {
        "ranks": len(records),
        "steps_measured": len(steady),
        "tokens_per_second_median": statistics.median(r["tokens_per_second"] for r in steady),
        "step_seconds_median": statistics.median(r["step_seconds"] for r in steady),
        "step_seconds_p90": sorted(r["step_seconds"] for r in steady)[int(0.9 * (len(steady) - 1))],
        "mfu_median": statistics.median(r["mfu"] for r in steady),
        "peak_flops_per_device": steady[0]["peak_flops"],
        "peak_source": steady[0]["peak_source"],
        "phases_median_seconds": {
            phase: statistics.median(r["phases"][phase] for r in steady) for phase in steady[0]["phases"]
        },
        "peak_rss_mib_per_rank": {rank: recs[-1]["max_rss_mib"] for rank, recs in sorted(records.items())},
        "peak_rss_mib_max": max(recs[-1]["max_rss_mib"] for recs in records.values()),
        "loss_first_last": [records[0][0]["loss"], records[0][-1]["loss"]],
        "launch_to_exit_seconds": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "train_throughput.json")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts:
            records, wall = run_layout(name, LAYOUTS[name], args.steps, Path(tmp) / name)
            results[name] = summarise(records, args.warmup, wall)
            print(f"{name}: {results[name]['tokens_per_second_median']:.0f} tok/s, "
                  f"{results[name]['step_seconds_median']:.3f} s/step, MFU {100 * results[name]['mfu_median']:.2f}%, "
                  f"peak RSS {results[name]['peak_rss_mib_max']:.0f} MiB/rank", flush=True)
    out = {
        "benchmark": "train_throughput",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "steps": args.steps,
        "warmup_steps_skipped": args.warmup,
        "layouts": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
