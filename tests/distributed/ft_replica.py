"""One replica group of a torchft job (torchft 0.2.0), one rank: what tests/distributed/test_torchft_probe.py starts
three of to see what torchft does on this machine's torch and gloo before megaheal builds on it (issue: fault
tolerance per data-parallel replica).

Each group has its own TCPStore (a replica group is a world of its own) and joins the others through the
Lighthouse each step; a group that joins behind takes a peer's live state through megaheal's authenticated
transport (train/ft/transport.py), not torchft's own. Every step's global batch is the same 12 samples whoever takes part: the participating
replicas split it by their rank in the quorum, and the gradients are summed (each replica's loss is its samples'
summed loss over 12), so a step's update does not depend on how many replicas took part. One JSON line per committed
step: the step, the participants, the loss, the weights' checksum after the update, the time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import TCPStore

GLOBAL_BATCH = 12


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--sleep", type=float, default=0.1)
    p.add_argument("--out", required=True)
    p.add_argument("--key-file", required=True, help="the run's key (0600): the live state moves only between its holders")
    a = p.parse_args()

    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    from train.ft.transport import SignedTransport

    store = TCPStore("127.0.0.1", a.store_port, is_master=True, wait_for_workers=False)  # noqa: F841 - the group's own
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, object]) -> None:
        model.load_state_dict(sd["model"])  # type: ignore[arg-type]
        inner.load_state_dict(sd["optim"])  # type: ignore[arg-type]

    timeout = timedelta(seconds=10)
    transport: SignedTransport[dict[str, object]] = SignedTransport(Path(a.key_file).read_bytes(), "127.0.0.1",
                                                                    timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=a.min_replicas,
                      checkpoint_transport=transport,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"group{a.group}",
                      lighthouse_addr=a.lighthouse, rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=a.store_port, hostname="127.0.0.1", timeout=timeout,
                      quorum_timeout=timedelta(seconds=30), connect_timeout=timeout, use_async_quorum=False)
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    out = Path(a.out)
    with out.open("a") as f:
        while manager.current_step() < a.steps:
            opt.zero_grad()  # the quorum; a replica that is behind heals here from a peer's state
            step, n, me = manager.current_step(), manager.num_participants(), manager.participating_rank()
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
            mine = slice(me, None, n) if me is not None else slice(0, 0)
            # NOTE: torchft's DDP averages over the participants: scaled back to a sum of the global batch's mean.
            loss = (ddp(x[mine]) - y[mine]).pow(2).sum() / GLOBAL_BATCH * n
            loss.backward()
            opt.step()
            if manager.current_step() > step:  # committed
                bits = sum(int(t.detach().view(torch.int32).to(torch.int64).sum()) for t in model.parameters())
                f.write(json.dumps({"group": a.group, "pid": os.getpid(), "step": step, "participants": n,
                                    "loss": loss.item() / n, "checksum": bits, "time": time.time()}) + "\n")
                f.flush()
            time.sleep(a.sleep)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
