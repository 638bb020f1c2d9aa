"""The trainer's measurements on a GPU beyond the plain run: telemetry on/off, memory, a kernel profile.

Run by bench/gpu_check.sh on a lent GPU machine (also runs on CPU with a CPU config, for a dry run):

    python bench/gpu_train.py --config configs/gpt-1b-1gpu.yaml --out OUT/train_extras.json \
        [--warmup 5 --block 5 --blocks 4 --profile-steps 2] [--variant parallel.microbatches=1]

One process drives a `Trainer` step by step (world size 1, as `python -m train` does without torchrun):
`warmup` steps, then `blocks` blocks of `block` steps that alternate between no telemetry client (a
NullRankClient, what a rank gets without MEGAHEAL_SIDECAR_SOCKET) and a real RankClient sending every
record to a socket that a separate process drains (the full encode-and-send path); then the peak device
memory; then `profile_steps` steps under torch.profiler, summarised by kernel category (GEMM, attention,
optimizer, other) with the GPU's busy time against the step's wall time. `--variant KEY=VALUE` repeats a
short measurement with those overrides (e.g. one microbatch of 8 instead of two of 4) in the same process.
Everything goes to one JSON file.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from exporters.client import SOCKET_ENV, NullRankClient, RankClient
from train.config import load_config
from train.trainer import Trainer
from wire.step_record import to_line

RECEIVER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
while True:
    s.recv(1 << 20)
"""


# ---------------------------------------------------------------- summaries


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of a list of step records, and each phase's share of the median step."""
    step = statistics.median(r["step_seconds"] for r in records)
    phases = {p: statistics.median(r["phases"].get(p, 0.0) for r in records) for p in records[0]["phases"]}
    return {
        "steps": len(records),
        "tokens_per_second_median": statistics.median(r["tokens_per_second"] for r in records),
        "step_seconds_median": step,
        "step_seconds_min_max": [min(r["step_seconds"] for r in records), max(r["step_seconds"] for r in records)],
        "mfu_median": statistics.median(r["mfu"] for r in records),
        "phases_median_seconds": phases,
        "phases_share_of_step": {p: v / step for p, v in phases.items()},
    }


def slim(record: dict[str, Any], **extra: Any) -> dict[str, Any]:
    keys = ("step", "loss", "grad_norm", "step_seconds", "tokens_per_second", "mfu", "phases", "max_rss_mib")
    return {**{k: record[k] for k in keys}, **extra}


def memory(device: torch.device) -> dict[str, float] | None:
    if device.type != "cuda":
        return None
    mib = 1 << 20
    return {"max_allocated_mib": torch.cuda.max_memory_allocated(device) / mib,
            "max_reserved_mib": torch.cuda.max_memory_reserved(device) / mib,
            "device_total_mib": torch.cuda.get_device_properties(device).total_memory / mib}


# ---------------------------------------------------------------- telemetry on/off


def start_receiver(path: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, path])
    deadline = time.monotonic() + 10
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the telemetry receiver did not bind {path}")
        time.sleep(0.05)
    return proc


def telemetry_blocks(trainer: Trainer, block: int, blocks: int, sock: str) -> dict[str, Any]:
    """Alternate blocks without and with a real client; the client's records really leave the process."""
    place = trainer.place
    client = RankClient.from_env(trainer.cfg.job or "gpu-check", place.rank, place.local_rank, place.world_size,
                                 place.coords(), environ={SOCKET_ENV: sock})
    client.hello()
    arms: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    steps = []
    for b in range(blocks):
        arm = "off" if b % 2 == 0 else "on"
        trainer.telemetry = client if arm == "on" else NullRankClient()
        for _ in range(block):
            rec = to_line(trainer.step())
            arms[arm].append(rec)
            steps.append(slim(rec, telemetry=arm))
    trainer.telemetry = NullRankClient()
    out = {arm: summarise(recs) for arm, recs in arms.items() if recs}
    if "on" in out and "off" in out:
        out["mfu_on_over_off"] = out["on"]["mfu_median"] / out["off"]["mfu_median"]
    out["client"] = {"sent": client.sent, "dropped": client.dropped}
    client.close()
    return {"summary": out, "steps": steps}


# ---------------------------------------------------------------- kernel profile


def kernel_category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "wgmma")):
        return "gemm"
    if any(k in n for k in ("multi_tensor", "foreach")):
        return "foreach (optimizer, clip, norm)"
    return "other (elementwise, norms, casts, reductions, loss)"


def profile_steps(trainer: Trainer, n: int, tmp: Path) -> dict[str, Any]:
    """Kernel time by category over n steps, and how much of the wall time the GPU was busy."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        records = [to_line(trainer.step()) for _ in range(n)]
    wall = time.perf_counter() - t0
    trace = tmp / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    by_cat: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        cat = kernel_category(e["name"]) if e["cat"] == "kernel" else e["cat"]
        by_cat[cat] = by_cat.get(cat, 0.0) + e["dur"] / 1e6
        by_name.setdefault(e["name"], []).append(e["dur"] / 1e6)
    busy = _union_seconds([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    total = sum(by_cat.values())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {
        "steps": n,
        "wall_seconds": wall,
        "step_seconds_profiled": [r["step_seconds"] for r in records],
        "kernel_seconds_total": total,
        "gpu_busy_seconds": busy,
        # NOTE: the wall time includes the profiler's own overhead; compare busy per step with the unprofiled steps.
        "gpu_busy_per_step_seconds": busy / n,
        "gpu_busy_share_of_wall": busy / wall if wall else None,
        "kernel_seconds_by_category": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "kernel_share_by_category": {k: v / total for k, v in by_cat.items()} if total else {},
        "kernel_launches": len(kernels),
        "top_kernels": [{"name": name[:160], "category": kernel_category(name), "calls": len(d), "seconds": sum(d)}
                        for name, d in top],
    }


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals given in microseconds, in seconds."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e6


# ---------------------------------------------------------------- runs


def build(config: str, overrides: list[str], steps: int, tmp: Path, name: str) -> Trainer:
    cfg = load_config(config, overrides + [f"steps={steps}"])
    return Trainer(cfg, tmp / name)


def main_run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    total = args.warmup + args.block * args.blocks + args.profile_steps
    t0 = time.perf_counter()
    trainer = build(args.config, args.set, total, tmp, "main")
    built = time.perf_counter() - t0
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out: dict[str, Any] = {"build_seconds": built, "overrides": args.set, "steps_total": total}
    receiver = start_receiver(str(tmp / "sidecar.sock"))
    try:
        out["warmup_steps"] = [slim(to_line(trainer.step())) for _ in range(args.warmup)]
        out["telemetry"] = telemetry_blocks(trainer, args.block, args.blocks, str(tmp / "sidecar.sock"))
        out["memory"] = memory(device)
        print(json.dumps({"telemetry": out["telemetry"]["summary"], "memory": out["memory"]}, indent=1), flush=True)
        if args.profile_steps:
            try:
                out["profile"] = profile_steps(trainer, args.profile_steps, tmp)
            except Exception as exc:  # noqa: BLE001 -- the profile is extra evidence; the numbers above stand
                out["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        receiver.kill()
        receiver.wait()
        trainer.close()
    del trainer
    return out


def variant_run(args: argparse.Namespace, tmp: Path, overrides: list[str]) -> dict[str, Any]:
    steps = args.warmup + args.variant_steps
    try:
        trainer = build(args.config, args.set + overrides, steps, tmp, "variant")
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.device)
        try:
            records = [to_line(trainer.step()) for _ in range(steps)]
        finally:
            trainer.close()
        return {"overrides": overrides, **summarise(records[args.warmup:]), "memory": memory(trainer.device)}
    except Exception as exc:  # noqa: BLE001 -- a variant that fails (say, out of memory) is a result
        return {"overrides": overrides, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=5, help="steps per telemetry block")
    parser.add_argument("--blocks", type=int, default=4, help="blocks, alternating off/on (off first)")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                        help="overrides of a second, short measurement (repeatable; all apply together)")
    parser.add_argument("--variant-steps", type=int, default=8)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"config": args.config, "torch": torch.__version__,
                              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                              "host": socket.gethostname()}
    with tempfile.TemporaryDirectory(prefix="gpu-train-") as d:
        tmp = Path(d)
        result["main"] = main_run(args, tmp)
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # the main numbers survive a failing variant
        if args.variant:
            gc.collect()  # the main run's trainer holds the device memory until collected
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            result["variant"] = variant_run(args, tmp, args.variant)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
