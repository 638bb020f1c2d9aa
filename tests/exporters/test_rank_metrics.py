"""The sidecar's rank table and its Prometheus families: budget, liveness, lag, restarts, promtool-clean."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporters.heartbeat import rank_summary
from exporters.rank_collector import SERIES_PER_RANK_BUDGET, RankCollector
from exporters.ranks import RankTable
from tests.exporters.helpers import step_record
from tests.exporters.promtools import promtool_check_metrics, wait_for
from wire.telemetry import RankEntry, build_record, decode, encode

pytestmark = pytest.mark.multiprocess


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def message(kind: str, rank: int, body: dict, pid: int = 100, dropped: int = 0, job: str = "job-a"):
    return decode(encode(build_record(kind, job, rank, pid + rank, dropped, body)))


def hello(rank: int, **kw):
    return message("hello", rank, {"local_rank": rank, "node": "host-a", "world_size": 4,
                                   "mesh": {"pp": rank // 2, "dp": rank % 2, "tp": 0}}, **kw)


def scrape(table: RankTable, node: str = "node-1") -> tuple[str, dict[str, list]]:
    registry = CollectorRegistry()
    RankCollector(table, node, registry=registry)
    text = generate_latest(registry).decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return text, samples


def value(samples, name: str, **labels) -> float:
    matches = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, f"{name}{labels}: {matches}"
    return matches[0]


def test_every_rank_stays_within_the_series_budget_and_promtool_passes() -> None:
    table = RankTable(clock=FakeClock(), process_state=lambda pid: "S", start_time=lambda pid: 1.0)
    for rank in range(4):
        table.observe(hello(rank))
        extra_phases = {f"extra_{i}": 0.001 for i in range(6)}  # a future trainer's phases: still capped
        rec = step_record(3, rank=rank, mesh={"pp": rank // 2, "dp": rank % 2, "tp": 0})
        rec["phases"].update(extra_phases)
        table.observe(message("step", rank, rec))
        for name in ("checkpoint_saved", "checkpoint_failed", "exception", f"custom_{rank}"):
            table.observe(message("event", rank, {"name": name, "time": time.time(), "fields": {}}))
    text, samples = scrape(table)
    per_rank: dict[str, int] = {}
    for name, items in samples.items():
        for s in items:
            if "rank" in s.labels:  # the step-duration histogram is the node's, not a rank's
                per_rank[s.labels["rank"]] = per_rank.get(s.labels["rank"], 0) + 1
    assert sorted(per_rank) == ["0", "1", "2", "3"]
    assert max(per_rank.values()) <= SERIES_PER_RANK_BUDGET, per_rank
    assert len(samples["megaheal_step_seconds"]) == 4 * 7, "the total and 6 phases per rank, extras cut"
    assert value(samples, "megaheal_step", rank="2", job="job-a", node="node-1") == 3
    assert value(samples, "megaheal_step_seconds", rank="1", phase="dp_reduce") == 0.05
    for kind in ("checkpoint_saved", "checkpoint_failed", "exception"):
        assert value(samples, "megaheal_rank_events_total", rank="0", kind=kind) == 1
    assert value(samples, "megaheal_rank_info", rank="3", pp="1", dp="1", tp="0", local_rank="3") == 1
    code, problems = promtool_check_metrics(text)
    assert (code, problems) == (0, []), problems


def test_a_ranks_pid_given_to_another_process_is_not_the_rank_alive() -> None:
    # The rank's process ended and the kernel gave its pid to another one (it runs, state S): by its start time,
    # not the rank. Once gone before its first record was read, a rank is not alive under that pid either.
    started = {100: 5.0}
    table = RankTable(clock=FakeClock(), process_state=lambda pid: "S", start_time=lambda pid: started.get(pid))
    table.observe(hello(0))
    assert [(s.alive, s.proc_state) for s in table.snapshot()] == [(True, "S")]
    started[100] = 9.0  # another process now
    assert [(s.alive, s.proc_state) for s in table.snapshot()] == [(False, None)]
    table.observe(message("hello", 1, {"local_rank": 1, "node": "h", "world_size": 2, "mesh": {}}, pid=777))
    assert [(s.rank, s.alive) for s in table.snapshot()] == [(0, False), (1, False)]


def test_silent_dead_and_restarted_ranks_are_told_apart() -> None:
    clock, dead = FakeClock(), set()
    table = RankTable(clock=clock, process_state=lambda pid: None if pid in dead else "S", forget_after_s=60,
                      start_time=lambda pid: 1.0)
    for rank in range(2):
        table.observe(hello(rank, dropped=5))
        table.observe(message("step", rank, step_record(10, rank=rank), dropped=5))
    clock.now += 30
    table.observe(message("step", 0, step_record(11, rank=0), dropped=5))
    dead.add(101)  # rank 1's process
    _, samples = scrape(table)
    assert value(samples, "megaheal_rank_last_seen_seconds", rank="0") == 0
    assert value(samples, "megaheal_rank_last_seen_seconds", rank="1") == 30
    assert value(samples, "megaheal_rank_up", rank="0") == 1 and value(samples, "megaheal_rank_up", rank="1") == 0
    assert value(samples, "megaheal_telemetry_dropped_total", rank="1") == 5
    # Rank 1 comes back as a new process: its old numbers are not carried over.
    table.observe(message("hello", 1, {"local_rank": 1, "node": "h", "world_size": 2, "mesh": {}}, pid=500))
    _, samples = scrape(table)
    assert value(samples, "megaheal_rank_up", rank="1") == 1
    assert value(samples, "megaheal_telemetry_dropped_total", rank="1") == 0
    assert [s.labels["rank"] for s in samples["megaheal_step"]] == ["0"], "the new process has no step yet"
    # A rank silent for longer than forget_after_s leaves the metrics, though its process lives (rank 0's does).
    clock.now += 40
    table.observe(message("step", 1, step_record(1, rank=1), pid=500))  # rank 1's new process goes on
    clock.now += 21
    _, samples = scrape(table)
    assert {s.labels["rank"] for s in samples["megaheal_rank_up"]} == {"1"}


def test_the_reduce_lag_compares_ranks_at_the_same_step() -> None:
    table = RankTable(clock=FakeClock(), process_state=lambda pid: "S", start_time=lambda pid: 1.0)
    enter = {0: 5_000_000_000, 1: 5_250_000_000, 2: 5_010_000_000}
    for rank, ns in enter.items():
        table.observe(message("step", rank, step_record(4, rank=rank, dp_reduce_enter_ns=ns)))
    table.observe(message("step", 3, step_record(3, rank=3, dp_reduce_enter_ns=1)))  # a step behind: alone
    _, samples = scrape(table)
    lags = {s.labels["rank"]: round(s.value, 6) for s in samples["megaheal_dp_reduce_lag_seconds"]}
    assert lags == {"0": 0.0, "1": 0.25, "2": 0.01, "3": 0.0}


def test_a_table_refuses_ranks_beyond_its_bound() -> None:
    table = RankTable(clock=FakeClock(), process_state=lambda pid: "S", max_ranks=2, start_time=lambda pid: 1.0)
    for rank in range(3):
        table.observe(hello(rank))
    assert len(table) == 2 and table.rejected == 1


def test_a_rank_whose_process_is_a_zombie_or_gone_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    table = RankTable(clock=FakeClock())  # its own probe of /proc
    table.observe(hello(0, pid=child.pid))
    table.observe(hello(1, pid=os.getpid() - 1))  # message() adds the rank to the pid: this process
    try:
        # Not reaped yet: the process is a zombie, which is what a crashed rank looks like before torchrun reaps it.
        wait_for("the child to become a zombie", lambda: not table.snapshot()[0].alive, timeout_s=10, every_s=0.05)
    finally:
        child.wait()
    assert [s.alive for s in table.snapshot()] == [False, True], "reaped: gone"


def test_a_stopped_rank_is_alive_and_its_heartbeat_says_it_is_stopped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    table = RankTable(clock=FakeClock())  # its own probe of /proc
    table.observe(hello(0, pid=child.pid))
    try:
        wait_for("the child asleep", lambda: table.snapshot()[0].proc_state == "S", timeout_s=10, every_s=0.05)
        os.kill(child.pid, signal.SIGSTOP)
        wait_for("the child stopped", lambda: table.snapshot()[0].proc_state == "T", timeout_s=10, every_s=0.05)
        (state,) = table.snapshot()
        assert state.alive, "a stopped process can run again: alive"
        entry = rank_summary(state)
        assert (entry.alive, entry.proc_state) == (True, "T")
        assert msgspec.json.decode(msgspec.json.encode(entry), type=RankEntry) == entry, "as the healer decodes it"
    finally:
        child.kill()
        child.wait()
    (state,) = table.snapshot()
    assert (state.alive, state.proc_state, rank_summary(state).proc_state) == (False, None, None), "reaped: gone"
