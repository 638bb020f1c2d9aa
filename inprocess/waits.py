"""Waits on gloo work that a generation's abort can end, for the ranks of a warm generation.

Gloo does not wake a send or a receive that is on the wire when its connection fails: its pair's error reaches the
operations still queued (`localPendingRecv_`, `localPendingSend_`, a bound buffer's), not the receive whose payload
is being read (moved to `rx_` by `prepareRead`) nor an unbound send being written (`tx_`, whose unbound buffer
`signalException` skips): gloo/transport/tcp/pair.cc. What waits on them waits for the group's timeout, or for ever
where the wait has none (a point-to-point Work's, and every blocking collective's on the calling thread):
- a warm rank stayed in an aborted generation's pipeline receive (tests/multihost/test_warm_across_hosts.py, 1 fresh
  make test in 7); tests/distributed/test_interruptible_waits.py cuts a 400 MB receive mid-payload and shows it;
- FSDP all-gathers waited on work whose gloo thread sat in `UnboundBuffer::waitSend` under `gloo::allgather`, every
  socket of the group closed (native stacks, tests/distributed/test_warm_generations.py: 4 ranks in 11 runs here).
Such a rank ended itself LEAVE_WITHIN_S after the abort (inprocess/generations.py), and its job restarted cold.

So a rank of a warm generation waits on gloo work in a way the abort can end: a collective's work in slices (a
timed-out wait of a collective changes nothing in gloo), point-to-point work on a thread of its own while the rank's
thread watches (a timed-out wait of a send or receive closes every pair of its context: measured, torch 2.13). Once
the generation is aborted (`Interrupt.set`), the wait raises GenerationAborted and the rank leaves. A waiting thread
that gloo never wakes is left behind, parked on a buffer no one fills (one per lost wake-up); the next wait has a new
one. gloo's own threads still in such a wait end at the group's timeout; inprocess/leave.py leaves the group without
waiting for them. Without an armed interrupt (torchrun, a single process) every wait is gloo's own.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")
SLICE_S = 0.1
"""How long a wait runs before it looks whether its generation was aborted (the abort's own delay is 0.05 s)."""


class GenerationAborted(RuntimeError):
    """The generation this rank waited in was aborted (the pool planned the next one)."""


class Interrupt:
    """Set once by the thread that aborts a generation; read by every wait of the generation's ranks."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self._aborted = threading.Event()

    def set(self) -> None:
        self._aborted.set()

    def is_set(self) -> bool:
        return self._aborted.is_set()

    def check(self, waited_on: str) -> None:
        if self._aborted.is_set():
            raise GenerationAborted(f"generation {self.generation} was aborted while this rank waited on "
                                    f"{waited_on}")


_armed: Interrupt | None = None
"""The interrupt of the generation this process runs now (a warm worker runs one at a time), or None."""


def arm(generation: int) -> Interrupt:
    """Make the waits of `generation` interruptible; returns what its abort sets."""
    global _armed
    _armed = Interrupt(generation)
    return _armed


def armed() -> bool:
    """Whether the waits of this process's generation are interruptible now."""
    return _armed is not None


def disarm(interrupt: Interrupt) -> None:
    global _armed
    if _armed is interrupt:
        _armed = None


def wait_collective(work: dist.Work, what: str = "a collective") -> None:
    """`work.wait()`, in slices while a generation is armed."""
    interrupt = _armed
    if interrupt is None:
        work.wait()
        return
    piece = timedelta(seconds=SLICE_S)
    while True:
        try:
            work.wait(timeout=piece)
            return
        except RuntimeError:
            if work.is_completed():
                # NOTE: done since the slice ran out, or failed (a peer left): the untimed wait returns at once, or
                # raises gloo's own error. Raising the slice's timeout here failed a generation that was fine.
                work.wait()
                return
        interrupt.check(what)


class _Waiter:
    """One daemon thread that runs the waits handed to it, one after another."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future[None]]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="megaheal-p2p-wait").start()

    def _serve(self) -> None:
        while True:
            wait, done = self._jobs.get()
            try:
                wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the rank's thread, which raises it
                done.set_exception(exc)
            else:
                done.set_result(None)

    def submit(self, wait: Callable[[], object]) -> Future[None]:
        done: Future[None] = Future()
        self._jobs.put((wait, done))
        return done


_waiter: _Waiter | None = None


def wait_point_to_point(wait: Callable[[], object], what: str = "a send or receive") -> None:
    """`wait()` (gloo's untimed wait on point-to-point work), on the waiter's thread while a generation is armed."""
    call(wait, what)


def call(blocking: Callable[[], T], what: str) -> T:
    """`blocking()`'s result: a call that waits on gloo in a way no slice can end (a point-to-point wait, or
    collectives DTensor issues itself, which wait inside a C++ op), made on the waiter's thread while a generation
    is armed, so that its abort ends the rank's wait (GenerationAborted). The rank's thread waits meanwhile, so the
    rank's collectives stay in the order every rank issues them."""
    global _waiter
    interrupt = _armed
    if interrupt is None:
        return blocking()
    if _waiter is None:
        _waiter = _Waiter()
    result: list[T] = []
    done = _waiter.submit(lambda: result.append(blocking()))
    while True:
        try:
            done.result(timeout=SLICE_S)
            return result[0]
        except FutureTimeout:
            pass
        if interrupt.is_set():
            _waiter = None  # its thread may never come back
            interrupt.check(what)
