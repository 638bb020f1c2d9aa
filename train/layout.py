"""The parallel layout: degrees, their validation in one place, and the (pp, dp, tp) DeviceMesh.

Mesh order follows MegaScale's placement rule: tensor parallel innermost (consecutive ranks,
so a tp group stays inside a node and its heavy traffic stays on NVLink), data parallel next,
pipeline parallel outermost (its point-to-point traffic is the lightest).
"""

from __future__ import annotations

from dataclasses import dataclass

from ground.typedconfig import ConfigError
from train.model import ModelConfig

SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    pp: int = 1
    """Pipeline-parallel degree (outermost mesh dim)."""
    dp: int = 1
    """Data-parallel degree; gradients and optimizer state are sharded over it (ZeRO-2 style)."""
    tp: int = 1
    """Tensor-parallel degree (innermost mesh dim)."""
    sequence_parallel: bool = True
    """With tp > 1, also shard norms and residuals along the sequence."""
    schedule: str = "1f1b"
    """Pipeline schedule: 1f1b, interleaved-1f1b or gpipe."""
    virtual_stages: int = 1
    """Pipeline stages per pp rank; > 1 needs schedule interleaved-1f1b."""
    microbatches: int = 1
    """Microbatches per step on each data-parallel rank (pipeline microbatches or gradient accumulation)."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "virtual_stages", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages


class LayoutError(ConfigError):
    """The layout does not fit the world size, the model or the batch; the message says what to change."""


def validate_layout(par: ParallelConfig, model: ModelConfig, global_batch: int, world_size: int) -> None:
    """Check every constraint between degrees, world size, model shape and batch, in one place."""
    problems = []
    if par.world_size != world_size:
        problems.append(
            f"pp x dp x tp = {par.pp} x {par.dp} x {par.tp} = {par.world_size}, but the job has {world_size} "
            f"processes: change the degrees or launch {par.world_size} processes"
        )
    if global_batch % par.dp:
        problems.append(f"global_batch ({global_batch}) must be a multiple of parallel.dp ({par.dp})")
    else:
        local = global_batch // par.dp
        if local % par.microbatches:
            problems.append(
                f"the per-dp-rank batch (global_batch / dp = {local}) must be a multiple of "
                f"parallel.microbatches ({par.microbatches})"
            )
    if par.pp == 1 and par.virtual_stages > 1:
        problems.append("parallel.virtual_stages > 1 needs parallel.pp > 1")
    if par.virtual_stages > 1 and par.schedule != "interleaved-1f1b":
        problems.append(
            f"parallel.virtual_stages = {par.virtual_stages} needs schedule interleaved-1f1b (got {par.schedule})"
        )
    if par.pp > 1:
        if model.n_layers % par.n_stages:
            problems.append(
                f"model.n_layers ({model.n_layers}) must be a multiple of the pipeline stages "
                f"pp x virtual_stages = {par.pp} x {par.virtual_stages} = {par.n_stages}"
            )
        if par.microbatches < par.pp:
            problems.append(
                f"parallel.microbatches ({par.microbatches}) must be >= parallel.pp ({par.pp}) "
                "so that every stage has work in the steady state"
            )
        elif par.schedule == "interleaved-1f1b" and par.microbatches % max(1, par.microbatches // par.pp):
            problems.append(
                f"interleaved-1f1b needs parallel.microbatches ({par.microbatches}) to be a multiple of "
                f"microbatches // pp = {par.microbatches // par.pp}; use a multiple of pp ({par.pp})"
            )
    if par.tp > 1:
        for name, value in (("n_heads", model.n_heads), ("ffn_dim", model.ffn_dim), ("vocab_size", model.vocab_size)):
            if value % par.tp:
                problems.append(f"model.{name} ({value}) must be a multiple of parallel.tp ({par.tp})")
        if par.sequence_parallel and model.seq_len % par.tp:
            problems.append(
                f"model.seq_len ({model.seq_len}) must be a multiple of parallel.tp ({par.tp}) with "
                "sequence_parallel; or set parallel.sequence_parallel=false"
            )
    if problems:
        raise LayoutError("invalid parallel layout:\n  - " + "\n  - ".join(problems))


def stage_ids(pp_rank: int, par: ParallelConfig) -> list[int]:
    """Pipeline stages held by `pp_rank`: r, r + pp, r + 2pp, ... (the interleaved assignment)."""
    return [pp_rank + v * par.pp for v in range(par.virtual_stages)]


def stage_layers(stage: int, par: ParallelConfig, n_layers: int) -> range:
    """Global layer indices of pipeline stage `stage`: an equal contiguous block."""
    per_stage = n_layers // par.n_stages
    return range(stage * per_stage, (stage + 1) * per_stage)
