"""Process-level set-up of one rank: config, process group, run directory, then the Trainer."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from inprocess.leave import leave_process_group
from train.config import TrainConfig, load_config
from train.trainer import Trainer


def run_rank(config_path: str | None, overrides: list[str], run_dir: str | None) -> Path:
    """Train one rank of the job described by the config; returns the run directory."""
    cfg = load_config(config_path, overrides)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        _init_process_group(cfg)
    try:
        return _train(cfg, run_dir, distributed)
    finally:
        leave_process_group()


def _train(cfg: TrainConfig, run_dir: str | None, distributed: bool) -> Path:
    out = _agree_on_run_dir(run_dir)
    if not distributed or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    trainer = Trainer(cfg, out)
    # Preemption: SIGTERM asks for a final checkpoint at the end of the current step, agreed by all ranks.
    signal.signal(signal.SIGTERM, lambda signum, frame: trainer.request_stop())
    trainer.run()
    return out


def _init_process_group(cfg: TrainConfig) -> None:
    timeout = timedelta(seconds=cfg.dist_timeout_s)
    store = _restart_store(timeout)
    group: dict[str, Any] = {"timeout": timeout}
    if store is not None:
        group.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    if cfg.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), **group)
    else:
        dist.init_process_group("gloo", **group)


def _restart_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun, the agent's store with a prefix of this restart's own; None elsewhere (env:// as usual).

    NOTE: torchrun keeps one store for the whole job, and the keys a round of workers wrote are still there when
    it restarts them (`--max-restarts`): the new workers then read the dead round's addresses and fail in gloo's
    connectFullMesh ("Connection refused") or hang (torch 2.13; pytorch/pytorch#167288 for NCCL). A prefix per
    restart gives every round clean keys (../shared/notes/pytorch-distributed-on-cpu.md has the reproduction).
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if restart is None or not addr or not port:
        return None
    base = dist.TCPStore(addr, int(port), int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"megaheal-restart-{restart}/", base)


def _agree_on_run_dir(run_dir: str | None) -> Path:
    """The given directory, or runs/<timestamp> chosen by rank 0 so that every rank writes to the same one."""
    if run_dir is not None:
        return Path(run_dir)
    chosen = [time.strftime("runs/%Y%m%d-%H%M%S")]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])
