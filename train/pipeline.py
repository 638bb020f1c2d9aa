"""Pipeline parallelism: the stages a rank holds and the schedule that drives them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule

from train.layout import ParallelConfig
from train.model import GPT


def build_schedule(
    chunks: list[GPT],
    stage_indices: list[int],
    par: ParallelConfig,
    pp_group: ProcessGroup,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineSchedule:
    """Wrap each chunk in a PipelineStage and build the configured schedule over them.

    Stage input/output shapes are inferred on the first step (a metadata exchange), so a
    stage with sequence parallelism passes its local sequence shard without extra setup.
    The schedule divides gradients by the number of microbatches (scale_grads), so the
    gradient is the mean over the whole batch, as in a single-process step.
    """
    stages = [
        PipelineStage(chunk, index, par.n_stages, device, group=pp_group)
        for chunk, index in zip(chunks, stage_indices, strict=True)
    ]
    if par.schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=par.microbatches, loss_fn=loss_fn)
    single = Schedule1F1B if par.schedule == "1f1b" else ScheduleGPipe
    return single(stages[0], n_microbatches=par.microbatches, loss_fn=loss_fn)
