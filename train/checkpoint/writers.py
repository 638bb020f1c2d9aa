"""Who writes a job's checkpoints, for the `writers` field of every manifest: per host, its ranks
and their devices, a GPU by its UUID. A host later convicted of silent data corruption is named in the checkpoints it
wrote (healer.decide.plans.untainted)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from train.sdc_faults import this_node


def writers(device: torch.device, world: int) -> dict[str, dict[str, list[Any]]]:
    """Per host (MEGAHEAL_NODE, else the hostname), its ranks and their devices; one all-gather where world > 1."""
    mine = (this_node(), dist.get_rank() if world > 1 else 0, _device_name(device))
    every: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    out: dict[str, dict[str, list[Any]]] = {}
    for node, rank, name in every:
        entry = out.setdefault(node, {"ranks": [], "devices": []})
        entry["ranks"].append(rank)
        entry["devices"].append(name)
    return out


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"cuda:{device.index} GPU-{uuid}" if uuid is not None else f"cuda:{device.index}"
