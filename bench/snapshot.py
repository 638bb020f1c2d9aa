"""What an in-memory snapshot (train/warm/: Snapshot.take, then Replicas.add) stalls training for, by the size of a
rank's state: the copy to host memory, the serialisation and checksum, and the exchange with the peer that keeps the
replica (two ranks over gloo on this machine's loopback). The simulation's `checkpoint.snapshot_stall`
(configs/sim/llama3-16k.yaml) is sourced from it.

Run:  .venv/bin/python bench/snapshot.py [--mib 64 346] [--repeats 3] [--out bench/results/snapshot.json]

346 MiB is a rank's share of Llama 3 405B's training state on 16,384 GPUs (405e9 parameters x 14 bytes: bf16
weights, fp32 master weights and two Adam moments, over 16,384 ranks). On a GPU the first stage is a device-to-host
copy instead of a memory copy, and the exchange crosses the host's NIC instead of loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from train.warm.replicas import Replica, Replicas
from train.warm.snapshot import Snapshot

TENSOR_MIB = 16
"""The state is cut in tensors of this size (a layer's weights and moments are each a tensor of about this much)."""


def state_of(mib: int) -> dict[str, object]:
    per = TENSOR_MIB * 2**20 // 4
    return {"model": {f"w{i}": torch.randn(per) for i in range(max(1, mib // TENSOR_MIB))},
            "train": {"step": 7, "sample_index": 1234}}


def rank_main(rank: int, mibs: list[int], repeats: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    replicas = Replicas(rank, 2, 1, keep=2)
    rows = []
    for mib in mibs:
        state = state_of(mib)
        for _ in range(repeats + 1):  # the first of each size warms the allocator and the connection
            dist.barrier()
            t0 = time.perf_counter()
            snap = Snapshot.take(state, 7, rank, "bench")
            t1 = time.perf_counter()
            payload = Replica.of(snap.to_bytes())
            t2 = time.perf_counter()
            replicas._exchange(payload)
            t3 = time.perf_counter()
            rows.append({"mib": mib, "copy_s": t1 - t0, "serialise_s": t2 - t1, "exchange_s": t3 - t2,
                         "stall_s": t3 - t0})
        del state
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, nargs="+", default=[64, 346])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "snapshot.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = os.path.join(tmp, "rows.json")
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(rank_main, args=(args.mib, args.repeats, init, rows_file), nprocs=2, join=True)
        rows = json.loads(Path(rows_file).read_text())
    results = []
    for mib in args.mib:
        runs = [r for r in rows if r["mib"] == mib][1:]
        results.append({"mib": mib, **{k: round(statistics.median(r[k] for r in runs), 4)
                                       for k in ("copy_s", "serialise_s", "exchange_s", "stall_s")},
                        "stall_s_all": [round(r["stall_s"], 4) for r in runs]})
    payload = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                           "loadavg_at_end": list(os.getloadavg())},
               "what": "Snapshot.take + Replicas.add's serialisation and exchange, rank 0 of 2 (gloo, loopback), "
                       f"median of {args.repeats}",
               "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    for r in results:
        print(f"{r['mib']:>5} MiB: stall {r['stall_s']:.3f} s (copy {r['copy_s']:.3f}, serialise {r['serialise_s']:.3f},"
              f" exchange {r['exchange_s']:.3f})")


if __name__ == "__main__":
    main()
