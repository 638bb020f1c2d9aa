"""megaheal.rank: what any trainer calls so that megaheal sees its steps (API version 1, see docs/your-trainer.md).

    import megaheal.rank as mh

    mh.watch(model, optimizer)           # times forward_backward, optimizer and data_wait by hooks
    for batch in loader:
        loss = ...; loss.backward(); optimizer.step()
        mh.step(loss=loss.item(), grad_norm=norm, tokens=batch_tokens)

Under `megaheal run` each call hands a record to the node's sidecar over a non-blocking local socket; elsewhere
(plain torchrun, a notebook) every call does nothing. No call blocks, and none raises into the training loop: a
failure is logged once and the record dropped. The standard library, msgspec and torch's own hooks only.

What a rank is told by megaheal (the restart count; after a rollback, the checkpoint's step to resume from and the
steps to skip) is read with `restart_count()`, `resume_step()` and `skip_steps()`; the rest of the contract is
torchrun's environment. `restartable` wraps a training function for in-process restarts (megaheal/rank/restart.py);
the Lightning and Hugging Face callbacks are in megaheal/rank/lightning.py and huggingface.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from megaheal.rank.reporter import Reporter, guarded
from wire import rank_env

API_VERSION = 1
"""Bumped when a call changes meaning or loses an argument; additions keep it."""

__all__ = ["API_VERSION", "Restart", "enabled", "event", "loss", "phase", "phase_begins", "phase_ends", "restart_count",
           "restartable", "resume_step", "skip_steps", "step", "watch"]

_reporter: Reporter | None = None
_looked = False
_watches: list[Any] = []


def _get() -> Reporter | None:
    global _reporter, _looked
    if not _looked:
        _looked = True
        _reporter = Reporter.from_env()
    return _reporter


def _install(reporter: Reporter) -> None:
    """The bootstrap's reporter (megaheal/rank/bootstrap.py): the one every call of the script then uses."""
    global _reporter, _looked
    _reporter, _looked = reporter, True


@guarded(False)
def enabled() -> bool:
    """Whether this rank runs under megaheal (its records go somewhere)."""
    return _get() is not None


@guarded(None)
def step(step: int | None = None, *, loss: Any = None, grad_norm: Any = None, tokens: int | None = None,
         phases: Mapping[str, float] | None = None) -> None:
    """One training step ended. `step`: its number [default: one more than the last]; `loss`, `grad_norm`: floats
    or 0-d tensors (a tensor's value is read, which waits for it on a GPU: pass `.item()` where you already do);
    `tokens`: tokens this rank processed in the step; `phases`: seconds per phase you timed yourself, added to those
    timed by `phase` and `watch`. Phase names megaheal knows: data_wait, dp_gather, forward_backward, pp_wait,
    dp_reduce, grad_norm_clip, optimizer, checkpoint (others are left out)."""
    reporter = _get()
    if reporter is not None:
        reporter.step(step, loss=loss, grad_norm=grad_norm, tokens=tokens, phases=phases)


@guarded(None)
def loss(value: Any) -> None:
    """The step's loss, for a `watch(..., steps=True)` that ends steps by itself."""
    for w in _watches:
        w.loss = value


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the enclosed work as phase `name` of the current step (and say so where a hang would look)."""
    phase_begins(name)
    try:
        yield
    finally:
        phase_ends(name)


@guarded(None)
def phase_begins(name: str) -> None:
    """Phase `name` begins (for a framework's callbacks, whose start and end are separate hooks; else `phase`)."""
    reporter = _get()
    if reporter is not None:
        reporter.enter(name)


@guarded(None)
def phase_ends(name: str) -> None:
    """Phase `name`, begun with `phase_begins`, ends."""
    reporter = _get()
    if reporter is not None:
        reporter.leave(name)


@guarded(None)
def watch(model: Any = None, optimizer: Any = None, *, steps: bool = False, reduce: bool = True) -> Any:
    """Time forward_backward, optimizer and data_wait through hooks on `model` (an nn.Module) and `optimizer` (a
    torch.optim.Optimizer); with `steps`, every optimizer step also ends a step (the loss from `loss()`). For a
    DistributedDataParallel model, the wait in its gradient reduce is timed too (dp_reduce: what names a straggler)
    by a communication hook running DDP's own all-reduce, unless the model has a hook already or `reduce` is False.
    Returns a handle whose `remove()` takes the module and optimizer hooks off; None outside megaheal."""
    from megaheal.rank.hooks import Watch

    reporter = _get()
    if reporter is None:
        return None
    handle = Watch(reporter, model, optimizer, steps, reduce)
    _watches.append(handle)
    return handle


@guarded(None)
def event(name: str, **fields: Any) -> None:
    """Something that happened, e.g. event("checkpoint_saved", step=100, path="...")."""
    reporter = _get()
    if reporter is not None:
        reporter.event(name, fields)


def restart_count() -> int:
    """How many times the healer restarted the job before this attempt (0 on the first): resume when above 0."""
    return int(os.environ.get(rank_env.RESTART_COUNT) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def resume_step() -> int | None:
    """After a rollback, the step of the checkpoint to resume from (one you reported with
    event("checkpoint_saved", step=N)); None: your own choice (your newest)."""
    text = os.environ.get(rank_env.RESUME_STEP, "").strip()
    return int(text) if text.isdigit() else None


def skip_steps() -> frozenset[int]:
    """The steps whose batches to pass over after a rollback (a NaN or a loss spike there); empty: none. Raises
    ValueError when the variable megaheal set is malformed."""
    return rank_env.decode_steps(os.environ)


def __getattr__(name: str) -> Any:
    # NOTE: restartable and Restart load torch.distributed: only for a program that uses them.
    if name in ("restartable", "Restart"):
        from megaheal.rank import restart

        return getattr(restart, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
