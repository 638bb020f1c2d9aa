"""Launch a training job under torchrun on this machine (what `megaheal train` runs).

The launcher reads the config only to learn the world size (pp x dp x tp); the ranks read it
again themselves. It chooses the run directory so that it can print it, and runs torchrun
as an argument list (no shell).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from train.config import load_config
from train.layout import validate_layout


def torchrun_argv(config: str, overrides: Sequence[str], run_dir: Path, nproc: int) -> list[str]:
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(nproc),
        "-m", "train", "--config", config, "--run-dir", str(run_dir),
    ]
    for item in overrides:
        argv += ["--set", item]
    return argv


def launch(config: str, overrides: Sequence[str], run_dir: str | None) -> int:
    """Run the job to completion; returns torchrun's exit code."""
    cfg = load_config(config, overrides)
    # Fail fast, before any process starts, on a layout the ranks would reject.
    validate_layout(cfg.parallel, cfg.model, cfg.global_batch, cfg.parallel.world_size)
    out = Path(run_dir) if run_dir else Path(time.strftime("runs/%Y%m%d-%H%M%S"))
    env = dict(os.environ)
    # One thread per rank: ranks share the machine's cores; oversubscription slows everyone.
    env.setdefault("OMP_NUM_THREADS", "1")
    argv = torchrun_argv(config, overrides, out, cfg.parallel.world_size)
    print(f"megaheal train: {cfg.parallel.world_size} ranks "
          f"(pp {cfg.parallel.pp} x dp {cfg.parallel.dp} x tp {cfg.parallel.tp}) on {cfg.device}, run dir {out}",
          flush=True)
    return subprocess.run(argv, env=env, check=False).returncode
