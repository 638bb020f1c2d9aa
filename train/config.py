"""The training job's config: one typed tree loaded from YAML plus `--set key=value` overrides."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from ground.names import check_name
from ground.typedconfig import apply_overrides, from_mapping, load_yaml
from train.checkpoint.manager import CheckpointConfig
from train.data import DataConfig
from train.ft.config import FtConfig
from train.hang_faults import HangFault
from train.layout import ParallelConfig
from train.model import ModelConfig
from train.optim import OptimConfig
from train.replica_faults import ReplicaFlip
from train.rerun import RerunConfig
from train.sdc_faults import MatmulFlip, ParamFlip

DEVICES = ("cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    job: str | None = None
    """Job name in telemetry and incidents (ground/names.py's rule); default: made from the run directory's name."""
    steps: int = 20
    """Optimizer steps to run."""
    global_batch: int = 8
    """Samples per step over all data-parallel ranks."""
    seed: int = 0
    """Seeds the model initialisation (parameters are seeded by name, so every layout starts equal)."""
    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL, one GPU per rank)."""
    precision: str = "auto"
    """auto: bf16 autocast on cuda, fp32 on cpu; or fp32 / bf16."""
    peak_flops: float | None = None
    """Peak FLOP/s per device for MFU; unset: the GPU table, or a matmul probe on CPU."""
    dist_timeout_s: float = 600.0
    """Collective timeout of the process groups."""
    snapshot_every_steps: int = 0
    """Under a warm worker (train/warm/): keep this rank's state in memory, with a replica on a peer, every this
    many steps; 0: at the checkpoint steps (checkpoint.every_steps). A warm restart resumes from the newest one."""
    log_every: int = 1
    """Rank 0 prints a table row every this many steps (every rank still records every step)."""
    skip_steps: list[int] = field(default_factory=list)
    """Steps whose batch is passed over (a rollback past a loss spike or a NaN): such a step trains on the
    next batch instead, and the data position in later checkpoints includes the skip."""
    inject_nan_at_sample: int | None = None
    """Fault injection: after training on the batch that starts at this global sample index, the weights
    are set to NaN (a batch whose update poisoned the model: every replica's next step is NaN, so the re-runs call it
    `state`). A rollback that skips that batch (skip_steps) is what cures it."""
    inject_bad_sample: int | None = None
    """Fault injection: the batch holding this global sample index trains to a NaN loss on whichever ranks compute
    it (a poisoned batch, caught before its update: the re-runs call it `data` and the step is skipped)."""
    inject_matmul_flips: list[MatmulFlip] = field(default_factory=list)
    """Fault injection (silent data corruption, train/sdc_faults.py): a host's ranks flip a bit of a matmul output,
    e.g. `--set 'inject_matmul_flips=[{node: n2, from_step: 8, rate: 1.0}]'`."""
    inject_param_flips: list[ParamFlip] = field(default_factory=list)
    """Fault injection (train/sdc_faults.py): data-parallel rank `rank` flips a bit of its gathered copy of a weight
    at step `at_step`, once per run, e.g. `--set 'inject_param_flips=[{rank: 3, at_step: 6}]'`: the replica
    checksum names it that step (rerun.replica_checksum)."""
    rerun: RerunConfig = field(default_factory=RerunConfig)
    """Every step checked, and a suspect one re-run before its update (train/rerun.py)."""
    inject_spike_at_sample: int | None = None
    """Fault injection: after training on the batch that starts at this global sample index, every weight is
    multiplied by 4 (a bad batch that throws the model off without a NaN): the loss spikes, finite."""
    inject_hangs: list[HangFault] = field(default_factory=list)
    """Fault injection: a rank hangs at a step, as real hangs do (train/hang_faults.py: spin, data, collective,
    syscall), each once per run, e.g. `--set 'inject_hangs=[{mode: spin, at_step: 6, rank: 1}]'`."""
    inject_replica_flips: list[ReplicaFlip] = field(default_factory=list)
    """Fault injection, under a warm worker: keeper rank `rank` flips one bit of the replica it holds of the first
    snapshot at or after `after_step` (train/replica_faults.py), once per run, e.g.
    `--set 'inject_replica_flips=[{rank: 3, after_step: 10}]'`: a restart that needs that replica resumes from disk."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ft: FtConfig = field(default_factory=FtConfig)
    """Fault tolerance per data-parallel replica group (train/ft/): several groups, each a world of `parallel`'s
    layout, joined by a per-step quorum; a lost group costs the others a step, not a restart."""

    def __post_init__(self) -> None:
        # NOTE: YAML reads .nan and .inf: a NaN learning rate or an infinite collective timeout passed every
        # range check below and failed (or silently broke) every rank at start.
        _check_finite(self)
        if self.job is not None:
            check_name(self.job, "job")
        if self.snapshot_every_steps < 0:
            raise ValueError(f"snapshot_every_steps must be >= 0, got {self.snapshot_every_steps}")
        for name in ("steps", "global_batch", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.precision == "bf16" and self.device == "cpu":
            raise ValueError("precision bf16 is for device cuda; use fp32 or auto on cpu")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ValueError(f"peak_flops must be > 0 or unset, got {self.peak_flops}")
        if any(not isinstance(x, int) or x < 0 for x in self.skip_steps):
            raise ValueError(f"skip_steps must be step indices >= 0, got {self.skip_steps}")
        for name in ("inject_nan_at_sample", "inject_spike_at_sample", "inject_bad_sample"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dist_timeout_s <= 0:
            raise ValueError(f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")
        problems = self.ft.layout_problems(self.global_batch, self.parallel.dp, self.parallel.microbatches,
                                           self.parallel.pp)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def autocast_bf16(self) -> bool:
        return self.precision == "bf16" or (self.precision == "auto" and self.device == "cuda")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_finite(config: Any, prefix: str = "") -> None:
    """ValueError naming the dotted key of the first float in the config tree that is NaN or infinite."""
    for f in fields(config):
        value = getattr(config, f.name)
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(x, float) and not math.isfinite(x) for x in items):
            raise ValueError(f"{prefix}{f.name} must be a finite number, got {value}")
        if is_dataclass(value):
            _check_finite(value, f"{prefix}{f.name}.")


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load `path` (or the defaults when None), apply overrides, and validate into a TrainConfig."""
    data = load_yaml(path) if path is not None else {}
    apply_overrides(data, list(overrides))
    return from_mapping(TrainConfig, data, str(path) if path is not None else "config")
