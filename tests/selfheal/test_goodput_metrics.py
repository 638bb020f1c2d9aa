"""The goodput ledger as Prometheus metrics: over a run directory written the way test_goodput.py writes one,
scraped through a fresh registry and through the real HTTP server."""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import DuplicateTimeseries

from healer.core.goodput import CATEGORIES
from healer.runner.goodput_metrics import GoodputCollector, GoodputServer
from healer.jsonl import append_jsonl
from tests.selfheal.test_goodput import write, write_crash_run


def write_run(run_dir: Path) -> None:
    """test_goodput's crash run (two attempts over 33 s, 10 steps count, 2 were lost) and a hang still open."""
    write_crash_run(run_dir)
    hang = {"id": 2, "kind": "hang", "attempt": 1, "detected_at": 32.0, "state": "open"}
    append_jsonl(run_dir / "incidents.jsonl", {"event": "detected", "at": 32.0, "incident": hang})


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition page, keyed by name and sorted labels (parsing also proves the page valid)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return samples(generate_latest(registry).decode())


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_it_exports_the_wall_split_ettr_steps_attempts_and_incidents(tmp_path: Path) -> None:
    write_run(tmp_path)
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "llama-8b", registry=registry)
    got = scrape(registry)
    job = (("job", "llama-8b"),)
    per_category = {c: got[("megaheal_goodput_seconds", (("category", c), *job))] for c in CATEGORIES}
    assert per_category["productive"] == pytest.approx(9.5) and per_category["lost_work"] == pytest.approx(2.0)
    assert got[("megaheal_goodput_wall_seconds", job)] == 33.0
    assert sum(per_category.values()) == pytest.approx(33.0)
    assert got[("megaheal_goodput_ettr_ratio", job)] == pytest.approx(9.5 / 33, abs=1e-4)
    assert got[("megaheal_goodput_steps", job)] == 10
    assert got[("megaheal_goodput_lost_steps_total", job)] == 2
    assert got[("megaheal_goodput_attempts_total", job)] == 2
    incidents = {k[1]: v for k, v in got.items() if k[0] == "megaheal_incidents"}
    assert incidents == {(*job, ("kind", "crash"), ("state", "resolved")): 1,
                         (*job, ("kind", "hang"), ("state", "open")): 1}


def test_it_counts_incidents_of_one_kind_and_state_together(tmp_path: Path) -> None:
    write_run(tmp_path)
    more = [{"event": "detected", "at": 30.0 + i, "incident": {"id": 3 + i, "kind": "crash", "attempt": 1,
                                                                "detected_at": 30.0 + i, "state": "resolved"}}
            for i in range(2)]
    with (tmp_path / "incidents.jsonl").open("a") as f:
        f.writelines(json.dumps(e) + "\n" for e in more)
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "j", registry=registry)
    assert scrape(registry)[("megaheal_incidents", (("job", "j"), ("kind", "crash"), ("state", "resolved")))] == 3


def test_it_serves_an_empty_valid_page_before_the_supervisor_journal_exists(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "j", registry=registry)
    with caplog.at_level(logging.WARNING):
        assert scrape(registry) == {}
    assert not caplog.records  # not a fault: the run has not started yet


def test_it_rereads_the_run_only_after_the_cache_interval(tmp_path: Path, clock: Clock) -> None:
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "j", cache=timedelta(seconds=2), clock=clock, registry=registry)
    assert scrape(registry) == {}
    write_run(tmp_path)
    clock.now += 1.9
    assert scrape(registry) == {}  # still the cached answer
    clock.now += 0.1
    assert scrape(registry)[("megaheal_goodput_attempts_total", (("job", "j"),))] == 2


def test_a_truncated_last_ledger_line_still_scrapes_the_lines_before_it(tmp_path: Path) -> None:
    write_run(tmp_path)
    with (tmp_path / "incidents.jsonl").open("a") as f:
        f.write('{"event": "detected", "at": 33.0, "incident": {"id": 3, "ki')  # the loop died mid-write
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "j", registry=registry)
    got = scrape(registry)
    assert sum(v for k, v in got.items() if k[0] == "megaheal_incidents") == 2
    assert got[("megaheal_goodput_steps", (("job", "j"),))] == 10


@pytest.mark.parametrize("corrupt", [
    pytest.param(lambda d: (d / "incidents.jsonl").write_bytes(b'{"event": "det\xff\xfe\n'), id="not-utf8"),
    pytest.param(lambda d: write(d / "incidents.jsonl", [{"event": "detected", "at": 1.0}]), id="missing-key"),
    pytest.param(lambda d: (d / "ranks" / "0.jsonl").write_text('{"step": 1, "time": "x", "step_seconds": 1}\n'),
                 id="wrong-type"),
    pytest.param(lambda d: ((d / "ranks" / "0.jsonl").unlink(), (d / "ranks" / "0.jsonl").mkdir()), id="unreadable"),
])
def test_a_garbled_run_file_empties_the_page_and_warns_once(tmp_path: Path, clock: Clock, corrupt: object,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    write_run(tmp_path)
    corrupt(tmp_path)  # type: ignore[operator]
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "j", clock=clock, registry=registry)
    with caplog.at_level(logging.WARNING, logger="healer.runner.goodput_metrics"):
        for _ in range(3):
            assert scrape(registry) == {}
            clock.now += 10  # past the cache: every scrape reads the files again
    assert len(caplog.records) == 1 and "unreadable" in caplog.records[0].getMessage()


def test_a_repaired_file_exports_again_and_a_later_breakage_warns_again(tmp_path: Path, clock: Clock,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    write_run(tmp_path)
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "j", clock=clock, registry=registry)
    with caplog.at_level(logging.WARNING, logger="healer.runner.goodput_metrics"):
        for _ in range(2):
            (tmp_path / "incidents.jsonl").write_bytes(b"\xff\n")
            assert scrape(registry) == {}
            write_run(tmp_path)
            clock.now += 10
            assert scrape(registry)[("megaheal_goodput_attempts_total", (("job", "j"),))] == 2
            clock.now += 10
    assert len(caplog.records) == 2  # the same error, but a new episode of it


def test_a_second_collector_of_the_same_names_is_rejected(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "a", registry=registry)
    with pytest.raises(DuplicateTimeseries):
        GoodputCollector(tmp_path, "b", registry=registry)


@pytest.mark.parametrize("kwargs", [{"job": ""}, {"job": "a\nb"}, {"job": "j", "cache": timedelta(seconds=-1)}])
def test_it_refuses_a_bad_job_name_or_negative_cache(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GoodputCollector(tmp_path, **kwargs)  # type: ignore[arg-type]


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


def test_the_server_serves_the_ledger_on_a_free_loopback_port_and_stops_cleanly(tmp_path: Path) -> None:
    write_run(tmp_path)
    threads_before = set(threading.enumerate())
    server = GoodputServer(tmp_path, "llama-8b")
    port = server.start()
    try:
        assert port > 0 and server.url == f"http://127.0.0.1:{port}/metrics"
        got = samples(fetch(server.url))
        assert got[("megaheal_goodput_ettr_ratio", (("job", "llama-8b"),))] == pytest.approx(9.5 / 33, abs=1e-4)
        assert not any(name.startswith(("python_", "process_")) for name, _ in got)  # its own registry only
    finally:
        server.stop()
    server.stop()  # idempotent
    assert set(threading.enumerate()) <= threads_before
    with pytest.raises(OSError):
        fetch(f"http://127.0.0.1:{port}/metrics")


def test_the_server_serves_an_empty_page_for_a_run_without_a_journal(tmp_path: Path) -> None:
    server = GoodputServer(tmp_path, "j")
    server.start()
    try:
        assert samples(fetch(server.url)) == {}
    finally:
        server.stop()


def test_the_server_refuses_a_port_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="port"):
        GoodputServer(tmp_path, "j", port=70000)
