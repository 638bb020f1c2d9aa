"""Where a rank sits: its device, the job's (pp, dp, tp) DeviceMesh and its coordinates in it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from train.config import TrainConfig


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where this process sits: its global rank and its (pp, dp, tp) mesh coordinates."""

    rank: int
    world_size: int
    local_rank: int
    pp: int
    dp: int
    tp: int

    def coords(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}



def rank_device(kind: str) -> torch.device:
    if kind == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_mesh(cfg: TrainConfig, device: torch.device) -> DeviceMesh:
    par = cfg.parallel
    return init_device_mesh(device.type, (par.pp, par.dp, par.tp), mesh_dim_names=("pp", "dp", "tp"))


def rank_place(mesh: DeviceMesh | None, world: int) -> RankPlace:
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if mesh is None:
        return RankPlace(rank=rank, world_size=world, local_rank=local_rank, pp=0, dp=0, tp=0)
    return RankPlace(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        pp=mesh["pp"].get_local_rank(),
        dp=mesh["dp"].get_local_rank(),
        tp=mesh["tp"].get_local_rank(),
    )
