"""All-reduce STEPS times across the tasks of one srun step, printing a line after each.

Run as `srun -N2 --ntasks-per-node=1 python allreduce_loop.py MASTER PORT STEPS`: rank and world come
from Slurm; rank 0 serves the store on MASTER:PORT. After each step rank 0 prints "STEP <i> <sum>" (one
rank only: srun forwards the tasks' output in chunks, so lines of two tasks may run into each other);
each rank contributes rank + 1, so the sum is world * (world + 1) / 2.
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

master, port, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
timeout = timedelta(seconds=90)  # far longer than the test keeps a link down: it must block, not fail
store = dist.TCPStore(master, port, world, rank == 0, timeout)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
try:
    x = torch.ones(1 << 16)
    for i in range(steps):
        t = x * (rank + 1)
        dist.all_reduce(t)
        if rank == 0:
            print(f"STEP {i} {t[0].item():g}", flush=True)
        time.sleep(0.1)
finally:
    dist.destroy_process_group()
