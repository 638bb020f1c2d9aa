"""Per-step phase timing on every rank: the raw material of straggler detection.

On CPU every op is synchronous, so `perf_counter_ns` around a phase measures it. On CUDA
work is queued, so phases are bracketed with CUDA events and read once at the end of the
step, after the step has synchronised anyway (reading the loss), which adds no extra sync.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.pipelining import schedules as pipeline_schedules

from inprocess import waits
from wire.phase_now import PhaseBeacon

T = TypeVar("T")


class PhaseTimer:
    """Accumulates named phase durations for one step. `on_enter(name)` runs as each phase begins (the rank's
    phase-now beacon, then any injected hang), `on_exit()` as it ends."""

    def __init__(self, device: torch.device, on_enter: Callable[[str], None] | None = None,
                 on_exit: Callable[[], None] | None = None) -> None:
        self._cuda = device.type == "cuda"
        self._cpu_ns: dict[str, int] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._on_enter, self._on_exit = on_enter, on_exit

    @contextmanager
    def phase(self, name: str, host: bool = False) -> Iterator[None]:
        """Time the enclosed work; host=True times the host (e.g. waiting for data), not the device."""
        if self._on_enter is not None:
            self._on_enter(name)
        try:
            with self._timed(name, host):
                yield
        finally:
            if self._on_exit is not None:
                self._on_exit()

    @contextmanager
    def _timed(self, name: str, host: bool) -> Iterator[None]:
        if self._cuda and not host:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            t0 = time.perf_counter_ns()
            yield
            self._cpu_ns[name] = self._cpu_ns.get(name, 0) + time.perf_counter_ns() - t0

    def add_events(self, name: str, pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> None:
        """Adopt CUDA event pairs recorded elsewhere (e.g. on a communication stream)."""
        self._events.extend((name, s, e) for s, e in pairs)

    def add_seconds(self, name: str, seconds: float) -> None:
        self._cpu_ns[name] = self._cpu_ns.get(name, 0) + int(seconds * 1e9)

    def collect(self) -> dict[str, float]:
        """Phase -> seconds for the step, then reset. On CUDA, call after the step has synchronised."""
        out = {name: ns / 1e9 for name, ns in self._cpu_ns.items()}
        for name, start, end in self._events:
            out[name] = out.get(name, 0.0) + start.elapsed_time(end) / 1e3
        self._cpu_ns.clear()
        self._events.clear()
        return out


class Stopwatch:
    """Time spent in calls made inside a phase (a collective, a pipeline wait), kept until the step drains it into
    its PhaseTimer: CUDA events on the stream current at the call, or the host clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._cpu_ns = 0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def cuda(self) -> bool:
        return self._cuda

    def run(self, call: Callable[[], T], wait_on_cpu: bool = False) -> T:
        """`call()`, timed; `wait_on_cpu`: on CPU, the Work it returns (an async collective) is waited for within
        the time (inprocess/waits.py: in a warm generation, a wait its abort can end)."""
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = call()
            end.record()
            self._events.append((start, end))
            return out
        t0 = time.perf_counter_ns()
        out = call()
        if wait_on_cpu and out is not None:
            waits.wait_collective(out, "a data-parallel collective")  # type: ignore[arg-type]
        self._cpu_ns += time.perf_counter_ns() - t0
        return out

    def drain_into(self, timer: PhaseTimer, phase: str) -> None:
        """Move the time kept so far into `timer` as `phase`, and start again."""
        if self._cuda:
            timer.add_events(phase, self._events)
        else:
            timer.add_seconds(phase, self._cpu_ns / 1e9)
        self._cpu_ns, self._events = 0, []


class TimedReduceScatter(DefaultReduceScatter):
    """FSDP2's default gradient reduce-scatter, timed.

    Installed with `FSDPModule.set_custom_reduce_scatter`, it records for each step the time
    spent in the data-parallel reduce and the monotonic time this rank first entered it. A
    rank that enters late makes the others wait inside the reduce: comparing entry times
    across ranks tells a late rank from a slow network.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.enter_ns: int | None = None
        self._watch = Stopwatch(device)

    beacon: PhaseBeacon | None = None
    """Where the rank says it is now (set by the trainer): inside the reduce while it runs."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[override]
        with self.beacon.inside("dp_reduce") if self.beacon is not None else nullcontext():
            if self.enter_ns is None:
                self.enter_ns = time.monotonic_ns()
            # NOTE: on CUDA FSDP calls this inside its reduce-scatter stream context: events land on that stream.
            reduce = super().__call__
            if self._watch.cuda or not waits.armed():
                return self._watch.run(lambda: reduce(output_tensor, input_tensor, group, op, async_op),
                                       wait_on_cpu=async_op)
            # NOTE: in a warm generation on gloo, issued async and waited for here even when FSDP asks for a blocking
            # call: a blocking gloo call cannot be ended by the generation's abort (inprocess/waits.py). Elsewhere
            # FSDP's call is made as it asks.
            work = self._watch.run(lambda: reduce(output_tensor, input_tensor, group, op, True), wait_on_cpu=True)
            return work if async_op else None

    def drain_into(self, timer: PhaseTimer, phase: str = "dp_reduce") -> int | None:
        """Move this step's reduce time into `timer`; return and reset the entry time."""
        self._watch.drain_into(timer, phase)
        enter, self.enter_ns = self.enter_ns, None
        return enter


class TimedAllGather(DefaultAllGather):
    """FSDP2's default parameter all-gather, timed (installed with `FSDPModule.set_custom_all_gather`).

    With ZeRO-2 every step starts by all-gathering the sharded parameters, so a rank that is late into the
    step makes its data-parallel peers wait *here*, inside their forward, before any reduce. Without this
    timer that wait would count as their compute, and a slow rank would look no slower than its peers.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._watch = Stopwatch(device)

    beacon: PhaseBeacon | None = None
    """Where the rank says it is now (set by the trainer): inside the all-gather while it runs."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # type: ignore[override]
        with self.beacon.inside("dp_gather") if self.beacon is not None else nullcontext():
            # NOTE: on CUDA issued on FSDP's all-gather stream: the events time the transfer there (overlapped with
            # compute); on CPU FSDP would wait for it moments later, before the unit's forward, anyway.
            gather = super().__call__
            if self._watch.cuda or not waits.armed():
                return self._watch.run(lambda: gather(output_tensor, input_tensor, group, async_op),
                                       wait_on_cpu=async_op)
            work = self._watch.run(lambda: gather(output_tensor, input_tensor, group, True), wait_on_cpu=True)
            return work if async_op else None  # (async in a warm generation: TimedReduceScatter says why)

    def drain_into(self, timer: PhaseTimer, phase: str = "dp_gather") -> None:
        """Move this step's all-gather time into `timer`."""
        self._watch.drain_into(timer, phase)


_active_pipeline_waits: TimedPipelineWaits | None = None
"""The timer of the trainer that runs now (a warm worker builds one trainer per generation, one at a time)."""
_untimed_wait: Callable[[list[dist.Work]], None] | None = None
"""torch's own wait for the pipeline's point-to-point work, once wrapped."""


def _timed_wait(work: list[dist.Work]) -> None:
    assert _untimed_wait is not None
    timer = _active_pipeline_waits
    if timer is None:
        untimed = _untimed_wait
        waits.wait_point_to_point(lambda: untimed(work), "a pipeline send or receive")
    else:
        timer.wait(work)


class TimedPipelineWaits:
    """The time this rank's pipeline schedule is blocked in its sends and receives: waiting for another stage.

    Without it, a rank waiting for a slow stage's activations or gradients counted the wait as its own
    forward/backward, and its pipeline partner looked as slow as the straggler it waited for (the demo's 2 x 2 job:
    rank 0 at 0.43-0.61 s of forward/backward a step while rank 2, stopped 85% of the time, took 0.41-0.62 s and
    its stage peers 0.07-0.08 s; which of the two a window named flipped, so the straggler was missed one run in
    five). Every schedule of torch 2.13 waits for its point-to-point work through one module function,
    `schedules._wait_batch_p2p`; it is wrapped once per process (torch has no hook there: checked in
    tests/distributed/test_pipeline_waits.py, so a torch that moves it fails a test, not a job). On CUDA the waits
    are stream waits, timed with events on the stream that waits."""

    def __init__(self, device: torch.device) -> None:
        self._watch = Stopwatch(device)
        self.available = _wrap_schedules_wait()

    def activate(self) -> None:
        global _active_pipeline_waits
        _active_pipeline_waits = self

    def close(self) -> None:
        global _active_pipeline_waits
        if _active_pipeline_waits is self:
            _active_pipeline_waits = None

    def wait(self, work: list[dist.Work]) -> None:
        assert _untimed_wait is not None
        untimed = _untimed_wait
        if self._watch.cuda:
            self._watch.run(lambda: untimed(work))  # stream waits: they do not hold the host
        else:
            self._watch.run(lambda: waits.wait_point_to_point(lambda: untimed(work), "a pipeline send or receive"))

    def drain_into(self, timer: PhaseTimer, phase: str = "pp_wait") -> None:
        """Move this step's waiting into `timer`."""
        self._watch.drain_into(timer, phase)


def _wrap_schedules_wait() -> bool:
    """Wrap torch's pipeline wait once; False where this torch has none (the waits then stay in forward_backward)."""
    global _untimed_wait
    if _untimed_wait is not None:
        return True
    original = getattr(pipeline_schedules, "_wait_batch_p2p", None)
    if not callable(original):
        return False
    _untimed_wait = original
    pipeline_schedules._wait_batch_p2p = _timed_wait
    return True
