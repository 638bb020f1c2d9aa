"""Apply tensor/sequence parallelism and ZeRO-2-style data parallelism to a model chunk.

Order per pipeline chunk (fixed, as the composition requires): the chunk already holds only
its own layers -> tensor parallel (DTensor sharding of the weights) -> fully_shard over dp ->
wrapped in a PipelineStage by train.pipeline.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from train.timing import TimedAllGather, TimedReduceScatter
from train.model import GPT


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Megatron-style TP: column-split the first matmul of each branch, row-split the second.

    With sequence parallelism the activations between branches (norms, residual adds) are
    sharded along the sequence dim, and each branch all-gathers its input and
    reduce-scatters its output instead of all-reducing it.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.output is not None:
        if sequence_parallel:
            top["norm"] = SequenceParallel()
        # Full logits on every tp rank: the loss stays a plain cross-entropy.
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True)
    if top:
        parallelize_module(model, tp_mesh, top)

    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan["attention_norm"] = SequenceParallel()
            plan["attention"] = gather
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            if block.ffn_norm is not None:
                plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)


def apply_data_parallel(
    model: GPT,
    dp_mesh: DeviceMesh,
    reduce_timer: TimedReduceScatter,
    gather_timer: TimedAllGather,
    param_dtype: torch.dtype | None = None,
) -> None:
    """ZeRO-2-style sharding with FSDP2: one unit per block, then the chunk's root.

    reshard_after_forward=False keeps the gathered weights from forward to backward, so
    parameters are all-gathered once per step (ZeRO-2), while gradients and optimizer state
    stay sharded. Every unit reduces gradients through `reduce_timer` and gathers parameters
    through `gather_timer`, which time the data-parallel collectives without changing them.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    units: list[nn.Module] = list(model.layers.values())
    for block in units:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    for unit in [*units, model]:
        # fully_shard changed each unit's class in place to an FSDPModule subclass.
        cast(FSDPModule, unit).set_custom_reduce_scatter(reduce_timer)
        cast(FSDPModule, unit).set_custom_all_gather(gather_timer)
