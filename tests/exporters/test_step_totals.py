"""Exact step times under rate(): every step record a sidecar receives is counted (the node's step-duration
histogram, each rank's compute sum and count), not only the last one a scrape happens to see."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporters.client import RankClient
from exporters.ranks import COMPUTE_PHASES, STEP_BUCKETS, RankTable
from exporters.sidecar import Sidecar
from healer.observe.rank_columns import COMPUTE_PHASES as HEALER_COMPUTE_PHASES
from tests.exporters.helpers import PHASES, step_record
from tests.exporters.promtools import promtool_check_metrics, wait_for
from tests.exporters.test_rank_metrics import FakeClock, message, scrape, value

pytestmark = pytest.mark.unit
STEPS = 25


def samples_of(text: str) -> dict[str, list]:
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append(s)
    return found


def test_the_sidecars_metrics_count_every_step_record_it_received(tmp_path) -> None:
    cfg = Sidecar.Config(node="node-1", socket_path=str(tmp_path / "s.sock"), metrics_addr="127.0.0.1:0")
    sidecar = Sidecar(cfg, nvml=None)
    sidecar.start()
    clients = [RankClient(str(tmp_path / "s.sock"), "job-a", r, r, 2, {"pp": 0, "dp": r, "tp": 0}) for r in range(2)]

    def page() -> str:
        return urllib.request.urlopen(sidecar.metrics_url, timeout=5).read().decode()

    def counted(n: int) -> str:
        # NOTE: a step at a time: a burst overflows the socket's queue and the client drops (never waits).
        return wait_for(f"{n} step records counted", lambda: (t := page()) and
                        f'megaheal_step_duration_seconds_count{{job="job-a",node="node-1"}} {n}.0' in t and t,
                        timeout_s=10)

    try:
        for step in range(STEPS):
            for c in clients:
                c.step(step_record(step, rank=c.rank, step_seconds=0.2 + 0.01 * c.rank))
            text = counted(2 * (step + 1))
        assert [c.dropped for c in clients] == [0, 0]
        samples = samples_of(text)
        node = {"job": "job-a", "node": "node-1"}
        assert value(samples, "megaheal_step_duration_seconds_sum", **node) == pytest.approx(STEPS * (0.2 + 0.21))
        assert value(samples, "megaheal_step_duration_seconds_bucket", le="0.1", **node) == 0
        assert value(samples, "megaheal_step_duration_seconds_bucket", le="0.25", **node) == 2 * STEPS
        assert value(samples, "megaheal_step_duration_seconds_bucket", le="+Inf", **node) == 2 * STEPS
        for phase, seconds in PHASES.items():
            assert value(samples, "megaheal_step_phase_seconds_total", phase=phase, **node) == pytest.approx(
                2 * STEPS * seconds)
        compute = PHASES["forward_backward"] + PHASES["optimizer"]
        for rank in ("0", "1"):
            assert value(samples, "megaheal_rank_compute_seconds_count", rank=rank) == STEPS
            assert value(samples, "megaheal_rank_compute_seconds_sum", rank=rank) == pytest.approx(STEPS * compute)
        # The last-value gauge still holds the last step only.
        assert value(samples, "megaheal_step_seconds", rank="1", phase="total") == pytest.approx(0.21)
        assert promtool_check_metrics(text) == (0, [])
    finally:
        for c in clients:
            c.close()
        sidecar.stop()


def test_a_restarted_rank_counts_afresh_while_the_nodes_histogram_keeps_counting() -> None:
    clock = FakeClock()
    table = RankTable(clock=clock, process_state=lambda pid: "S", start_time=lambda pid: 1.0, forget_after_s=60)
    for step in range(3):
        table.observe(message("step", 0, step_record(step, step_seconds=0.5)))
    table.observe(message("step", 0, step_record(3, step_seconds=0.5), pid=900))  # a new process of rank 0
    _, samples = scrape(table)
    assert value(samples, "megaheal_rank_compute_seconds_count", rank="0") == 1, "a counter reset, as rate() reads it"
    assert value(samples, "megaheal_step_duration_seconds_count", job="job-a") == 4
    # A job whose ranks are all forgotten takes its histogram with it.
    clock.now += 61
    _, samples = scrape(table)
    assert "megaheal_step_duration_seconds_count" not in samples and "megaheal_step" not in samples


def test_steps_without_compute_phases_have_no_compute_series_and_bounds_are_inclusive() -> None:
    table = RankTable(clock=FakeClock(), process_state=lambda pid: "S", start_time=lambda pid: 1.0)
    table.observe(message("step", 0, {"step": 1, "time": 5.0, "step_seconds": STEP_BUCKETS[3]}))
    table.observe(message("step", 0, {"step": 2, "time": 6.0, "step_seconds": -1.0}))  # a clock that went back
    table.observe(message("step", 0, {"step": 3, "time": 7.0, "step_seconds": 1e4}))
    _, samples = scrape(table)
    assert "megaheal_rank_compute_seconds_count" not in samples
    bucket = lambda le: value(samples, "megaheal_step_duration_seconds_bucket", le=le)
    assert (bucket("0.01"), bucket(f"{STEP_BUCKETS[3]:g}"), bucket("600"), bucket("+Inf")) == (1, 2, 2, 3)
    assert value(samples, "megaheal_step_duration_seconds_sum", job="job-a") == pytest.approx(STEP_BUCKETS[3] + 1e4)


def test_the_sidecar_and_the_healer_mean_the_same_compute() -> None:
    assert COMPUTE_PHASES == HEALER_COMPUTE_PHASES
