"""What a checkpoint holds, gathered from and put back into a rank's training objects.

Model and optimizer state go through torch.distributed.checkpoint's state-dict helpers with
flattened optimizer keys, so entries are named by global parameter name and a checkpoint
saved at one (pp, dp, tp) layout loads at another: DCP reshards DTensors on load.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from train.model import GPT, ModelConfig

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelParts(nn.Module):
    """One module over a rank's pipeline chunks that names parameters as the whole model does.

    With interleaved pipelining a rank holds several chunks; wrapping them in a ModuleList would
    prefix names with the chunk index, which depends on the layout. Here the chunks' own
    submodules are re-registered under their global names (`layers.5...`, `output...`).
    """

    def __init__(self, chunks: list[GPT]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for chunk in chunks:
            self.layers.update(chunk.layers)
            for name in ("tok_embeddings", "norm", "output"):
                module = getattr(chunk, name)
                if module is not None:
                    self.add_module(name, module)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_hash(cfg: ModelConfig) -> str:
    """Identity of the model's shape: a checkpoint only loads into the same architecture."""
    return _digest(asdict(cfg))


def layout_hash(cfg: Any) -> str:
    """Identity of what shapes a rank's state (the model and the parallel layout): an in-memory snapshot goes back
    only into the same (a rollback's skipped steps or a longer run do not change it)."""
    return _digest({"model": asdict(cfg.model), "parallel": asdict(cfg.parallel)})


def config_hash(cfg: Any) -> str:
    """Identity of the whole training config (layout and schedule included), recorded for audit."""
    return _digest(asdict(cfg))


def capture(
    parts: ModelParts,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    steps_done: int,
    sample_index: int,
    rank: int,
) -> dict[str, Any]:
    """The state a resumed run needs to continue exactly where this one is."""
    rng = {f"rank{rank}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng[f"rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return {
        "model": get_model_state_dict(parts, options=_OPTIONS),
        "optim": get_optimizer_state_dict(parts, optimizer, options=_OPTIONS),
        "train": {
            "step": steps_done,
            "sample_index": sample_index,
            "lr_scheduler": lr_scheduler.state_dict(),
        },
        # RNG streams are per rank; they are restored only when the rank count is unchanged.
        "rng": rng,
    }


def load_template(
    parts: ModelParts,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank: int,
    same_world: bool,
) -> dict[str, Any]:
    """A state dict shaped for this rank's layout, for dcp.load to fill in place."""
    state = capture(parts, optimizer, lr_scheduler, steps_done=0, sample_index=0, rank=rank)
    if not same_world:
        del state["rng"]
    return state


def restore(
    state: dict[str, Any],
    parts: ModelParts,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank: int,
) -> tuple[int, int]:
    """Put a loaded state back into the training objects; returns (steps done, sample index)."""
    set_model_state_dict(parts, state["model"], options=_OPTIONS)
    set_optimizer_state_dict(parts, optimizer, state["optim"], options=_OPTIONS)
    lr_scheduler.load_state_dict(state["train"]["lr_scheduler"])
    rng = state.get("rng", {})
    if f"rank{rank}.cpu" in rng:
        torch.set_rng_state(rng[f"rank{rank}.cpu"])
    if f"rank{rank}.cuda" in rng:
        torch.cuda.set_rng_state(rng[f"rank{rank}.cuda"])
    return int(state["train"]["step"]), int(state["train"]["sample_index"])
