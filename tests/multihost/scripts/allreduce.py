"""One rank of a gloo all-reduce across hosts, under torchrun (env:// rendezvous from torchrun).

Prints "RESULT <hostname> <rank> <world> <sum>"; each rank contributes rank + 1.
"""

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
try:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"RESULT {socket.gethostname()} {dist.get_rank()} {dist.get_world_size()} {t.item():g}", flush=True)
finally:
    dist.destroy_process_group()
