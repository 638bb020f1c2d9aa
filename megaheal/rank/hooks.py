"""Phases a trainer need not time itself: module and optimizer hooks (megaheal.rank.watch).

- forward_backward: from the model's forward to the optimizer's step (the backward pass, and under DDP the gradient
  reduce that overlaps it, and whatever the loop does between, gradient clipping included);
- optimizer: the optimizer's step;
- data_wait: from the end of one optimizer step to the next forward (the data loader's wait and the loop's own work);
- dp_reduce, for a DistributedDataParallel model: from the moment its last gradient bucket is ready (the rank's own
  backward is done) to the end of that bucket's reduce, taken out of forward_backward. It is what tells a slow rank
  from its peers: they wait there for it, and its own is the shortest. Timed by a communication hook that calls DDP's
  own all-reduce (`reduce=False` leaves DDP's hook slot to a script that registers its own).

On a GPU these are host times: they measure when the host got on, not when the kernels ran (a trainer that knows
better reports `phases=` itself). With `steps=True` every optimizer step also ends a step record, with the loss last
given to megaheal.rank.loss.
"""

from __future__ import annotations

import threading
import time
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

    def __init__(self, reporter: Reporter, model: Any = None, optimizer: Any = None, steps: bool = False,
                 reduce: bool = True) -> None:
        self.reporter, self.steps = reporter, steps
        self.loss: Any = None
        self._in_step = False
        self._handles: list[Any] = []
        self.reduce: ReduceTimer | None = None
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._forward))
            if reduce:
                self.reduce = guarded(None)(ReduceTimer.install)(model)
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
        if self.reduce is not None:
            self.reporter.shift("forward_backward", "dp_reduce", self.reduce.take())
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
        """Takes the module and optimizer hooks off (DDP keeps a comm hook once given one: it goes on reducing)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class ReduceTimer:
    """DDP's gradient reduce as a communication hook that times it: when each step's last bucket was handed over and
    when the last reduce ended (`take`). DDP's own all-reduce does the work, so the gradients are what they were."""

    def __init__(self) -> None:
        self._ready = self._done = 0.0
        self._lock = threading.Lock()  # NOTE: a reduce ends on the process group's thread (gloo), not the loop's

    @classmethod
    def install(cls, model: Any) -> ReduceTimer | None:
        """The timer, as `model`'s comm hook; None for a model that is not DDP or already has a hook (the script's
        own: megaheal does not take its place)."""
        if not callable(getattr(model, "register_comm_hook", None)) or getattr(model, "_comm_hooks", None):
            return None
        timer = cls()
        model.register_comm_hook(getattr(model, "process_group", None), timer.hook)
        return timer

    def hook(self, state, bucket):  # NOTE: no annotations: DDP checks them against its own types
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        with self._lock:
            self._ready = time.perf_counter()
        return allreduce_hook(state, bucket).then(self._ended)

    def _ended(self, future: Any) -> Any:
        with self._lock:
            self._done = max(self._done, time.perf_counter())
        return future.value()

    def take(self) -> float:
        """Seconds from the step's last bucket handed over to its last reduce ended (0 when no reduce ran: a step
        under no_sync), and a fresh start for the next step."""
        with self._lock:
            waited = self._done - self._ready if self._ready else 0.0
            self._ready = self._done = 0.0
        return max(waited, 0.0)
