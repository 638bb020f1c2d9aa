"""megaheal.rank for Hugging Face's Trainer, as a TrainerCallback (its own extension point):

    from megaheal.rank.huggingface import MegahealCallback
    trainer = Trainer(..., callbacks=[MegahealCallback()])

Each optimizer step is a step (its number: the steps done before it). The Trainer reports its loss only when it logs:
at a logging step the step is sent with the logged loss and gradient norm (`logging_steps=1` gives every step's);
at the others, without. NOTE: the Trainer's `logging_nan_inf_filter` (on by default) hides a NaN loss from the logs;
the logged gradient norm still shows it. forward_backward runs from the step's start to the optimizer, optimizer to
the step's end, data_wait between steps. A saved checkpoint is an event.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

import megaheal.rank as mh
from megaheal.rank.hooks import PhaseSwitch


class MegahealCallback(TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self._switch = PhaseSwitch().switch

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._switch("data_wait")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._switch("forward_backward")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._switch("optimizer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._switch(None)
        if not _logs_at(args, state.global_step):
            mh.step(state.global_step - 1)
        self._switch("data_wait")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs and _logs_at(args, state.global_step):
            mh.step(state.global_step - 1, loss=logs["loss"], grad_norm=logs.get("grad_norm"))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._switch(None)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        mh.event("checkpoint_saved", step=int(state.global_step))


def _logs_at(args: Any, step: int) -> bool:
    """Whether the Trainer logs the training loss at optimizer step `step` (its `logging_steps` schedule)."""
    every = args.logging_steps
    if str(getattr(args.logging_strategy, "value", args.logging_strategy)) != "steps" or not every:
        return False
    every = every if every >= 1 else max(1, int(every * max(getattr(args, "max_steps", 0) or 0, 1)))
    return step % int(every) == 0
