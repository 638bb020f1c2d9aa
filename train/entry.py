"""Process-level set-up of one rank: config, process group, run directory, then the Trainer."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from train.config import TrainConfig, load_config
from train.trainer import Trainer


def run_rank(config_path: str | None, overrides: list[str], run_dir: str | None) -> Path:
    """Train one rank of the job described by the config; returns the run directory."""
    cfg = load_config(config_path, overrides)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        _init_process_group(cfg)
    try:
        out = _agree_on_run_dir(run_dir)
        if not distributed or dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        trainer = Trainer(cfg, out)
        # Preemption: SIGTERM asks for a final checkpoint at the end of the current step, agreed by all ranks.
        signal.signal(signal.SIGTERM, lambda signum, frame: trainer.request_stop())
        trainer.run()
        return out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_process_group(cfg: TrainConfig) -> None:
    timeout = timedelta(seconds=cfg.dist_timeout_s)
    if cfg.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo", timeout=timeout)


def _agree_on_run_dir(run_dir: str | None) -> Path:
    """The given directory, or runs/<timestamp> chosen by rank 0 so that every rank writes to the same one."""
    if run_dir is not None:
        return Path(run_dir)
    chosen = [time.strftime("runs/%Y%m%d-%H%M%S")]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])
