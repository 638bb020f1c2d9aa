"""Checkpoint cost on CPU: the training stall of an async save against a synchronous one.

Run:  .venv/bin/python bench/checkpoint.py [--sizes 50M 200M] [--repeats 3] [--out bench/results/checkpoint.json]

For each model size it builds the real Trainer in one process (AdamW, after one step so the
optimizer state exists), then times through the real Checkpointer:
- stall: how long `save()` blocks training (async: staging the copy; sync: the whole write + commit);
- write bandwidth: checkpoint bytes / time until the manifest is committed (sync save);
- load time: dcp.load of the newest checkpoint into a fresh state dict;
- extra host memory async saving holds: peak RSS during the saves minus RSS before the first one
  (the staging copy is kept and reused), against the size of the state (target: one staged copy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from megaheal import procfs  # noqa: E402
from train.checkpoint.state import capture, load_template  # noqa: E402
from train.config import load_config  # noqa: E402
from train.trainer import Trainer  # noqa: E402

# dim, layers, ffn: ~50M and ~200M parameters (byte vocabulary, so nearly all are in the blocks).
SIZES = {"50M": (512, 16, 1536), "200M": (1024, 16, 3072)}


class RssSampler:
    """Peak resident memory of this process while active, sampled every few milliseconds."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        return procfs.rss_bytes(os.getpid()) or 0  # this process: never gone

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def state_bytes(state) -> int:
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += state_bytes(value)
        elif isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def build(size: str, run_dir: Path, async_save: bool) -> Trainer:
    dim, layers, ffn = SIZES[size]
    cfg = load_config(None, [
        "steps=1000", "global_batch=2", f"model.dim={dim}", f"model.n_layers={layers}", f"model.ffn_dim={ffn}",
        "model.n_heads=8", "model.seq_len=64", f"checkpoint.async_save={str(async_save).lower()}",
        "checkpoint.keep_last=2", "log_every=1000",
    ])
    trainer = Trainer(cfg, run_dir)
    trainer.step()  # the optimizer state exists from here on
    return trainer


def measure(size: str, repeats: int, tmp: Path) -> dict:
    result: dict = {}
    for mode in ("sync", "async"):
        trainer = build(size, tmp / f"{size}-{mode}", async_save=mode == "async")
        params = sum(p.numel() for p in trainer.parts.parameters())
        stalls, totals, extra = [], [], []
        # Against the memory before the first save: an async save keeps its staging copy for reuse.
        base = RssSampler.rss()
        for i in range(repeats):
            state = capture(trainer.parts, trainer.optimizer, trainer.lr_scheduler, 1 + i, 0, 0)
            nbytes = state_bytes(state)
            with RssSampler() as sampler:
                t0 = time.perf_counter()
                trainer.checkpointer.save(state, 1 + i, 0)
                stalls.append(time.perf_counter() - t0)
                del state  # training would move on; only the staged copy must stay alive
                trainer.checkpointer.wait()
                totals.append(time.perf_counter() - t0)
            extra.append(max(0, sampler.peak - base))
        ckpt = trainer.checkpointer.dir / "step-{:08d}".format(repeats)
        written = sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file())
        template = load_template(trainer.parts, trainer.optimizer, trainer.lr_scheduler, 0, same_world=True)
        t0 = time.perf_counter()
        trainer.checkpointer.load(template, ckpt)
        load_seconds = time.perf_counter() - t0
        result[mode] = {
            "stall_seconds_median": statistics.median(stalls),
            "stall_seconds_all": stalls,
            "save_to_commit_seconds_median": statistics.median(totals),
            "extra_host_memory_mib_max": max(extra) / 2**20,
            "load_seconds": load_seconds,
            "bytes_written": written,
            "write_bandwidth_mib_per_s": written / 2**20 / statistics.median(totals),
        }
        result["parameters"] = params
        result["state_mib"] = nbytes / 2**20
        trainer.close()
    result["async_stall_over_sync_stall"] = result["async"]["stall_seconds_median"] / result["sync"]["stall_seconds_median"]
    result["async_extra_memory_in_state_copies"] = result["async"]["extra_host_memory_mib_max"] / result["state_mib"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "checkpoint.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            results[size] = measure(size, args.repeats, Path(tmp))
            r = results[size]
            print(f"{size}: {r['parameters'] / 1e6:.1f}M params, state {r['state_mib']:.0f} MiB; stall async "
                  f"{r['async']['stall_seconds_median']:.3f} s vs sync {r['sync']['stall_seconds_median']:.3f} s "
                  f"({100 * r['async_stall_over_sync_stall']:.0f}%), write {r['sync']['write_bandwidth_mib_per_s']:.0f} MiB/s, "
                  f"load {r['sync']['load_seconds']:.2f} s, async extra memory "
                  f"{r['async_extra_memory_in_state_copies']:.2f} x state", flush=True)
    out = {"benchmark": "checkpoint", "device": "cpu", "targets": {"async_stall_over_sync_stall": 0.25,
                                                                  "async_extra_memory_in_state_copies": 1.0},
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "repeats": args.repeats,
           "sizes": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
