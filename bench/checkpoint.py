"""Checkpoint cost on CPU: the training stall of an async save against a synchronous one, and what blake2b
checksums cost on save and on load.

Run:  .venv/bin/python bench/checkpoint.py [--sizes 50M 200M] [--repeats 3] [--out bench/results/checkpoint.json]
      .venv/bin/python bench/checkpoint.py --only checksums   # just the checksum costs, kept beside the rest

For each model size it builds the real Trainer in one process (AdamW, after one step so the
optimizer state exists), then times through the real Checkpointer:
- stall: how long `save()` blocks training (async: staging the copy; sync: the whole write + commit);
- write bandwidth: checkpoint bytes / time until the manifest is committed (sync save);
- load time: dcp.load of the newest checkpoint into a fresh state dict;
- extra host memory async saving holds: peak RSS during the saves minus RSS before the first one
  (the staging copy is kept and reused), against the size of the state (target: one staged copy).
- checksums: a synchronous save with and without the manifest's blake2b checksums (rank 0 hashes every file
  before the commit), and a resume's verification with sizes only and with checksums, against the load itself.
  The files are in the page cache (just written), as on a restart on the same node; from a cold shared
  filesystem reading them costs more on top.
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

from ground import procfs  # noqa: E402
from train.checkpoint import catalog  # noqa: E402
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


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - t0, result


def measure_checksums(size: str, repeats: int, tmp: Path) -> dict:
    """Sync saves with and without the manifest's checksums (alternating), then verification and load."""
    trainer = build(size, tmp / f"{size}-checksums", async_save=False)
    hashing = catalog.describe_files
    with_sums, without = [], []
    try:
        for i in range(repeats):
            for checksums, times in ((True, with_sums), (False, without)):
                step = 1 + 2 * i + (not checksums)
                state = capture(trainer.parts, trainer.optimizer, trainer.lr_scheduler, step, 0, 0)
                # NOTE: the save's commit calls catalog.describe_files(ckpt); leaving checksums out is this switch.
                catalog.describe_files = hashing if checksums else (lambda ckpt, checksums=False: hashing(ckpt, False))
                times.append(timed(trainer.checkpointer.save, state, step, 0)[0])
                del state
    finally:
        catalog.describe_files = hashing
    # The newest save whose manifest has checksums (the last one was saved without).
    info = next(c for c in catalog.list_checkpoints(trainer.checkpointer.dir) if "blake2b" in c.manifest["files"][0])
    nbytes = sum(f["size"] for f in info.manifest["files"])
    verify_sizes = statistics.median(timed(catalog.verify, info, False)[0] for _ in range(repeats))
    verify_sums = statistics.median(timed(catalog.verify, info, True)[0] for _ in range(repeats))
    template = load_template(trainer.parts, trainer.optimizer, trainer.lr_scheduler, 0, same_world=True)
    load = timed(trainer.checkpointer.load, template, info.path)[0]
    trainer.close()
    save_with, save_without = statistics.median(with_sums), statistics.median(without)
    return {
        "bytes": nbytes,
        "save_seconds_with_checksums": save_with, "save_seconds_without_checksums": save_without,
        "save_checksum_overhead": save_with / save_without - 1,
        "load_seconds": load,
        "verify_seconds_sizes": verify_sizes, "verify_seconds_checksums": verify_sums,
        "resume_checksum_overhead": (verify_sums - verify_sizes) / (load + verify_sizes),
        "hash_mib_per_s": nbytes / 2**20 / max(verify_sums - verify_sizes, 1e-9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["checksums"], help="measure only this part; keep the rest of --out")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "checkpoint.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.only == "checksums":
        write_checksums(args)
        return
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


def write_checksums(args: argparse.Namespace) -> None:
    sums = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            sums[size] = r = measure_checksums(size, args.repeats, Path(tmp))
            print(f"{size}: {r['bytes'] / 2**20:.0f} MiB; save {r['save_seconds_without_checksums']:.2f} s, with "
                  f"checksums {r['save_seconds_with_checksums']:.2f} s (+{100 * r['save_checksum_overhead']:.0f}%); "
                  f"resume: load {r['load_seconds']:.2f} s, verify sizes {r['verify_seconds_sizes']:.3f} s, "
                  f"checksums {r['verify_seconds_checksums']:.2f} s (+{100 * r['resume_checksum_overhead']:.0f}% "
                  f"of the resume); blake2b {r['hash_mib_per_s']:.0f} MiB/s on one core", flush=True)
    out = json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": "checkpoint", "device": "cpu"}
    out["checksums"] = {"repeats": args.repeats, "load_average_1m": os.getloadavg()[0],
                        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "sizes": sums}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
