"""megaheal.rank for a Lightning Trainer, as a Callback (Lightning's own extension point):

    from megaheal.rank.lightning import MegahealCallback
    trainer = pl.Trainer(..., callbacks=[MegahealCallback()])

Each training batch is a step (its number: the optimizer steps done before it), with its loss from the
training_step's output; forward_backward runs from the batch's start to the optimizer step, optimizer from there to
the batch's end, data_wait between batches. A saved checkpoint and an exception are events. For the `lightning`
package (`lightning.pytorch`) use LightningCallback, the same hooks on that package's Callback class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import megaheal.rank as mh
from megaheal.rank.hooks import PhaseSwitch


class _Hooks:
    """The hooks, on whichever Lightning package's Callback the class below is made from."""

    _phases: PhaseSwitch | None = None

    def _switch(self, phase: str | None) -> None:
        if self._phases is None:
            self._phases = PhaseSwitch()
        self._phases.switch(phase)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._switch("data_wait")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._switch("forward_backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._switch("optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._switch(None)
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        mh.step(max(int(trainer.global_step) - 1, 0), loss=loss)
        self._switch("data_wait")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._switch(None)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        mh.event("checkpoint_saved", step=int(trainer.global_step))

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        mh.event("exception", type=type(exception).__name__, message=str(exception)[:500])


def __getattr__(name: str) -> Any:
    # NOTE: made on first use, so that importing this module needs only the Lightning package the user has.
    if name == "MegahealCallback":
        import pytorch_lightning as pl

        cls = type("MegahealCallback", (_Hooks, pl.Callback), {"__doc__": "megaheal.rank for pytorch_lightning."})
    elif name == "LightningCallback":
        from lightning.pytorch import Callback

        cls = type("LightningCallback", (_Hooks, Callback), {"__doc__": "megaheal.rank for lightning.pytorch."})
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = cls
    return cls
