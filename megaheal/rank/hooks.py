"""Phases a trainer need not time itself: module and optimizer hooks (megaheal.rank.watch).

- forward_backward: from the model's forward to the optimizer's step (the backward pass, and under DDP the gradient
  reduce that overlaps it, and whatever the loop does between, gradient clipping included);
- optimizer: the optimizer's step;
- data_wait: from the end of one optimizer step to the next forward (the data loader's wait and the loop's own work).

On a GPU these are host times: they measure when the host got on, not when the kernels ran (a trainer that knows
better reports `phases=` itself). With `steps=True` every optimizer step also ends a step record, with the loss last
given to megaheal.rank.loss.
"""

from __future__ import annotations

from typing import Any

from megaheal.rank.reporter import Reporter, guarded


class PhaseSwitch:
    """One phase at a time for a framework's callbacks, whose hooks say where a step is, not when a phase ends:
    `switch("optimizer")` ends the phase before and begins that one (None: no phase)."""

    def __init__(self) -> None:
        self._open: str | None = None

    def switch(self, phase: str | None) -> None:
        import megaheal.rank as mh  # NOTE: here: megaheal.rank imports this module

        if self._open is not None:
            mh.phase_ends(self._open)
        self._open = phase
        if phase is not None:
            mh.phase_begins(phase)


class Watch:
    """The hooks on one model and optimizer; `remove()` takes them off."""

    def __init__(self, reporter: Reporter, model: Any = None, optimizer: Any = None, steps: bool = False) -> None:
        self.reporter, self.steps = reporter, steps
        self.loss: Any = None
        self._in_step = False
        self._handles: list[Any] = []
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._forward))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._before_optimizer))
            self._handles.append(optimizer.register_step_post_hook(self._after_optimizer))
        self.reporter.enter("data_wait")

    @guarded(None)
    def _forward(self, *_: Any) -> None:
        if self._in_step:
            return  # a second forward of the same step (gradient accumulation): still the same phase
        self._in_step = True
        self.reporter.leave("data_wait")
        self.reporter.enter("forward_backward")

    @guarded(None)
    def _before_optimizer(self, *_: Any) -> None:
        self.reporter.leave("forward_backward")
        self.reporter.enter("optimizer")

    @guarded(None)
    def _after_optimizer(self, *_: Any) -> None:
        self.reporter.leave("optimizer")
        self._in_step = False
        if self.steps:
            loss, self.loss = self.loss, None
            self.reporter.step(loss=loss)
        self.reporter.enter("data_wait")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
