"""One rank's reporter: the state behind megaheal.rank's functions, one per process.

It holds the rank's client (exporters/client.py: datagrams to the node's sidecar, never blocking), its phase beacon
(wire/phase_now.py: where a hung rank is stuck) and the step it is in: the phases timed since the last step, and
when that step began. Every public call goes through `guarded`, so a bug here or a bad value costs the record, is
logged once, and never raises into the training loop.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from exporters.client import RankClient
from wire import rank_env
from wire.phase_now import PhaseBeacon
from wire.telemetry import PHASE_ORDER

log = logging.getLogger("megaheal.rank")
T = TypeVar("T")


class Reporter:
    """What one rank has told and is telling: see the module."""

    def __init__(self, client: RankClient, beacon: PhaseBeacon | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.client, self.beacon, self._clock = client, beacon, clock
        self.last_step: int | None = None
        """The step last reported (by the trainer, or as collective progress)."""
        self.reports_steps = False
        """The trainer reports its own steps: the collective progress (megaheal/rank/progress.py) stands down."""
        self._step_began = clock()
        self._phases: dict[str, float] = {}
        self._open: list[tuple[str, float]] = []
        self._lock = threading.Lock()  # NOTE: the progress thread reports beside the training thread

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Reporter | None:
        """The reporter of a rank megaheal launched (a sidecar socket, a job and torchrun's RANK); None elsewhere."""
        if not environ.get(rank_env.SIDECAR_SOCKET) or not environ.get(rank_env.JOB) or "RANK" not in environ:
            return None
        rank = int(environ["RANK"])
        client = RankClient(environ[rank_env.SIDECAR_SOCKET], environ[rank_env.JOB], rank,
                            int(environ.get("LOCAL_RANK", "0")), int(environ.get("WORLD_SIZE", "1")), {},
                            node=environ.get(rank_env.NODE) or socket.gethostname())
        client.hello()
        return cls(client, PhaseBeacon.from_env(rank))

    # ---- phases ----------------------------------------------------------------------------------------

    def enter(self, phase: str) -> None:
        """`phase` of the current step begins (nested phases count inside their parent too)."""
        now = self._clock()
        if self.last_step is None and not self._open and not self._phases:
            # NOTE: the first step begins with its first phase, not with the process: the interpreter's start, the
            # imports and the process group's set-up would count as a step time the hang timeout learns from.
            self._step_began = now
            if self.beacon is not None:
                self.beacon.between(0)  # out of the bootstrap's "startup": training has begun
        self._open.append((phase, now))
        if self.beacon is not None:
            self.beacon.enter(phase, self._next_step())

    def leave(self, phase: str) -> None:
        """`phase` ends: its time is added to the step's (a phase entered twice in a step adds up)."""
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == phase:
                _, began = self._open.pop(i)
                self._phases[phase] = self._phases.get(phase, 0.0) + (self._clock() - began)
                break
        if self.beacon is not None:
            self.beacon.leave()

    def shift(self, source: str, target: str, seconds: float) -> None:
        """Count `seconds` of the step's `source` phase as `target` (a wait measured inside it), at most all of it."""
        moved = min(max(seconds, 0.0), self._phases.get(source, 0.0))
        if moved > 0:
            self._phases[source] -= moved
            self._phases[target] = self._phases.get(target, 0.0) + moved

    # ---- steps -----------------------------------------------------------------------------------------

    def step(self, step: int | None = None, *, loss: float | None = None, grad_norm: float | None = None,
             tokens: int | None = None, phases: Mapping[str, float] | None = None) -> None:
        """A step ended: one record with what the trainer knows (see megaheal.rank.step)."""
        now = self._clock()
        with self._lock:
            self.reports_steps = True
            number = self._next_step() if step is None else int(step)
            seconds = max(now - self._step_began, 0.0)
            timed = {**self._phases, **(phases or {})}
            self._phases, self._step_began, self.last_step = {}, now, number
        record: dict[str, Any] = {"step": number, "time": time.time(), "step_seconds": seconds,
                                  "phases": {k: float(v) for k, v in timed.items() if k in PHASE_ORDER}}
        if loss is not None:
            record["loss"] = _number(loss)
        if grad_norm is not None:
            record["grad_norm"] = _number(grad_norm)
        if tokens is not None and seconds > 0:
            record["tokens_per_second"] = float(tokens) / seconds
        self.client.step(record)
        if self.beacon is not None:
            self.beacon.between(number + 1)

    def progress(self, count: int, seconds: float) -> None:
        """Collective progress of a rank whose trainer reports no steps: `count` collectives done so far, the last
        of them `seconds` after the one reported before."""
        with self._lock:
            if self.reports_steps:
                return
            self.last_step = count
        self.client.step({"step": count, "time": time.time(), "step_seconds": max(seconds, 0.0)})
        if self.beacon is not None:
            self.beacon.between(count)

    def event(self, name: str, fields: Mapping[str, Any]) -> None:
        self.client.event(name, **fields)

    def close(self) -> None:
        self.client.close()
        if self.beacon is not None:
            self.beacon.close()

    def _next_step(self) -> int:
        return 0 if self.last_step is None else self.last_step + 1


def _number(value: Any) -> float:
    """A float from a Python number or a 0-d tensor (its .item(): on a GPU that waits for the value)."""
    item = getattr(value, "item", None)
    return float(item() if callable(item) else value)  # NaN and the infinities as they are: what the healer looks for


_warned: set[str] = set()


def guarded(default: T) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Run a public call so that it never raises into training: a failure is logged once per call and `default`
    is returned."""
    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> T:
            try:
                return fn(*args, **kwargs)
            except Exception:  # NOTE: the training loop must never see telemetry's failures
                if fn.__name__ not in _warned:
                    _warned.add(fn.__name__)
                    log.warning("megaheal.rank.%s failed; its records are dropped from now on when it fails",
                                fn.__name__, exc_info=True)
                return default
        return call
    return wrap
