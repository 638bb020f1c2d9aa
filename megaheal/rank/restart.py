"""In-process restart of a user's training function (megaheal.rank.restartable), in the spirit of NVRx's in-process
restart: under `megaheal run --warm`, each rank is a process that outlives its generations (inprocess/). When a peer
dies, the survivors' collectives are aborted, the function's call fails on every survivor, the process leaves the
process group, and once the healer plans the next generation the function is called again: with a new process
group, the same rank, and what the process chose to keep (`Restart.kept`); a standby already running takes the lost
rank. Nothing restarts from the interpreter up, and nothing is read from the disk unless the program does so.

Outside a warm pool (plain torchrun, `megaheal run` cold) the function is called once, in the process group torchrun's
environment describes (made here when the program has not made one, and then left here once the function returns).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist

import megaheal.rank as api
from megaheal.rank.progress import CollectiveProgress
from megaheal.rank.reporter import Reporter
from wire import rank_env
from wire.warm_plan import Plan

T = TypeVar("T")


@dataclass(slots=True)
class Restart:
    """What a call of the wrapped function is told about its generation."""

    generation: int
    """0 for the first formation; one more at every warm restart (a cold restart forms a new pool from 0 again)."""
    rank: int
    world_size: int
    kept: dict[str, Any] = field(default_factory=dict)
    """Survives in this process from one generation to the next: put the model, the optimizer and the step here.
    Empty in a process that never held a rank (the first generation, or a standby taking a lost rank's place)."""
    source: int | None = None
    """The lowest rank whose process kept its state from an earlier generation: where a new rank takes the state
    from (e.g. DDP broadcasts rank `source`'s parameters); None when no process kept any (load from the disk)."""

    @property
    def is_new(self) -> bool:
        """This process holds no state of the job yet."""
        return not self.kept


class _Pool:
    """The generations of one warm worker, and what its process keeps across them."""

    def __init__(self, fn: Callable[[Restart], Any]) -> None:
        from inprocess.abort import open_sockets
        from inprocess.generations import GenerationLoop, connect_to
        from wire.warm_seal import read_key

        self.fn, self.kept = fn, {}
        self.result: Any = _NOT_DONE
        secret = read_key(os.environ[rank_env.WARM_KEY_FILE])  # NOTE: plans not sealed with it are refused
        connect = connect_to(os.environ[rank_env.WARM_CONTROL])
        control, watch = connect(), connect()
        self.loop = GenerationLoop(control, os.environ[rank_env.WARM_WORKER], watch=watch, connect=connect,
                                   keep=open_sockets(), secret=secret)

    def serve(self) -> Any:
        code = self.loop.serve(self._generation, int(os.environ.get(rank_env.WARM_FROM) or 0))
        if code != 0 or self.result is _NOT_DONE:
            raise SystemExit(code)
        return self.result

    def _generation(self, plan: Plan, ready: Callable[[str], None]) -> None:
        self.result = _NOT_DONE
        reporter = Reporter.from_env()  # NOTE: per generation: the rank is known only now
        progress = None
        if reporter is not None:
            api._install(reporter)
            progress = CollectiveProgress(reporter).start()
        try:
            restart = Restart(plan.generation, dist.get_rank(), dist.get_world_size(), self.kept,
                              source=_lowest_keeper(bool(self.kept)))
            ready("memory (the program's own state)" if self.kept else
                  (f"a survivor (rank {restart.source})" if restart.source is not None else "disk"))
            self.result = self.fn(restart)
        finally:
            if progress is not None:
                progress.close()
            if reporter is not None:
                reporter.close()


_NOT_DONE = object()


def _lowest_keeper(kept: bool) -> int | None:
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, kept)
    return next((r for r, k in enumerate(flags) if k), None)


def restartable(fn: Callable[[Restart], T] | None = None, *, backend: str | None = None) -> Any:
    """Decorate the training function (`def train(restart: Restart)`) so that a failed peer restarts it in process:
    see the module. `backend`: of the process group made outside a warm pool when the program made none [default:
    nccl where CUDA is available, else gloo]. Calling the decorated function runs it (under a pool: generation after
    generation until one finishes, then returns its result; a standby that is never given a rank exits 0)."""
    def wrap(f: Callable[[Restart], T]) -> Callable[[], T]:
        @functools.wraps(f)
        def run() -> T:
            if os.environ.get(rank_env.WARM_CONTROL):
                return _Pool(f).serve()  # type: ignore[no-any-return]
            if dist.is_initialized():
                return f(Restart(0, dist.get_rank(), dist.get_world_size()))
            import torch

            dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
            try:
                return f(Restart(0, dist.get_rank(), dist.get_world_size()))
            finally:
                # NOTE: the group made here is left here, while the interpreter is whole: a script that never
                # destroys it (the one in tests/usertrainer/test_restartable_plain.py) had a gloo work freed during
                # finalisation, and a rank aborted ("terminate called without an active exception") in a fresh
                # make test.
                from inprocess.leave import leave_process_group

                leave_process_group()
        return run
    return wrap(fn) if fn is not None else wrap
