"""The gate heartbeats wait at while a detection cycle reads (healer/service/detection_first.py): they pass at
once when no cycle runs, wait for one that does and go the moment it ends (reopened from the detection thread,
as the service does), and never wait past their limit; what they waited is counted."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from healer.service.detection_first import DetectionFirst

pytestmark = pytest.mark.unit


def _gate(max_wait_s: float = 1.0) -> tuple[DetectionFirst, CollectorRegistry]:
    r = CollectorRegistry()
    return DetectionFirst(Counter("held_seconds", "h", registry=r), Counter("past_limit", "p", registry=r),
                          max_wait_s), r


def _counted(r: CollectorRegistry) -> tuple[float, float]:
    """(seconds held, requests past the limit) as the counters say."""
    return r.get_sample_value("held_seconds_total") or 0.0, r.get_sample_value("past_limit_total") or 0.0


def test_a_heartbeat_passes_at_once_when_no_cycle_runs() -> None:
    async def main() -> float:
        gate, _ = _gate()
        started = time.perf_counter()
        await gate.wait()
        return time.perf_counter() - started

    assert asyncio.run(main()) < 0.05


def test_a_heartbeat_waits_for_the_running_cycle_and_goes_when_the_detection_thread_reopens() -> None:
    async def main() -> tuple[float, float, float]:
        gate, r = _gate(max_wait_s=5.0)
        loop = asyncio.get_running_loop()
        gate.close()
        # The detection thread: its detectors take 0.3 s, then it reopens the gate through the loop.
        worker = threading.Thread(target=lambda: (time.sleep(0.3), loop.call_soon_threadsafe(gate.open)))
        started = time.perf_counter()
        worker.start()
        await asyncio.gather(gate.wait(), gate.wait())  # two requests held by the same cycle
        waited = time.perf_counter() - started
        worker.join()
        return (waited, *_counted(r))

    waited, held_s, past = asyncio.run(main())
    assert 0.25 < waited < 2.0 and past == 0
    assert held_s == pytest.approx(2 * waited, rel=0.2)  # each request's wait counted once


def test_a_heartbeat_never_waits_past_its_limit_for_a_cycle_that_does_not_end() -> None:
    async def main() -> tuple[float, float, bool]:
        gate, r = _gate(max_wait_s=0.2)
        with gate.closed():
            started = time.perf_counter()
            await gate.wait()
            waited = time.perf_counter() - started
        return waited, _counted(r)[1], gate.is_open

    waited, past, reopened = asyncio.run(main())
    assert 0.15 < waited < 1.5 and past == 1 and reopened


def test_the_gate_reopens_however_the_cycle_ends() -> None:
    gate, _ = _gate()
    with pytest.raises(RuntimeError), gate.closed():
        assert not gate.is_open
        raise RuntimeError("a detector failed")
    assert gate.is_open
    with pytest.raises(ValueError, match="max_wait_s"):
        _gate(max_wait_s=0)
