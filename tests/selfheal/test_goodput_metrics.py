"""The goodput ledger as Prometheus metrics: over a run directory written the way test_goodput.py writes one and
incidents as the healer's store gives them back, scraped through a fresh registry and through the real HTTP
server."""

from __future__ import annotations

import logging
import re
import threading
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import DuplicateTimeseries

from ground.typedconfig import ConfigError, from_mapping
from healer.errors import DatabaseError
from healer.ledger.goodput import CATEGORIES
from healer.ledger.metrics import GoodputCollector, GoodputServer
from tests.selfheal.test_goodput import CRASH, write, write_crash_run

pytestmark = pytest.mark.unit

HANG = {"id": 2, "kind": "hang", "attempt": 1, "detected_at": 32.0, "state": "open"}


class Store:
    """The run's incidents as the collector reads them from the healer's store; `down` makes the read fail."""

    def __init__(self) -> None:
        self.incidents: list[dict[str, object]] = []
        self.down = False

    def __call__(self) -> list[dict[str, object]]:
        if self.down:
            raise DatabaseError("cannot reach the database sqlite:///x: disk I/O error")
        return list(self.incidents)


def write_run(run_dir: Path, store: Store | None = None) -> Store:
    """test_goodput's crash run (two attempts over 33 s, 10 steps count, 2 were lost) and a hang still open."""
    write_crash_run(run_dir)
    store = store or Store()
    store.incidents = [CRASH, HANG]
    return store


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
    store = write_run(tmp_path)
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "llama-8b", store, registry=registry)
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
    store = write_run(tmp_path)
    store.incidents += [{"id": 3 + i, "kind": "crash", "attempt": 1, "detected_at": 30.0 + i, "state": "resolved"}
                        for i in range(2)]
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "j", store, registry=registry)
    assert scrape(registry)[("megaheal_incidents", (("job", "j"), ("kind", "crash"), ("state", "resolved")))] == 3


def test_it_serves_an_empty_valid_page_before_the_supervisor_journal_exists(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "j", Store(), registry=registry)
    with caplog.at_level(logging.WARNING):
        assert scrape(registry) == {}
    assert not caplog.records  # not a fault: the run has not started yet


def test_it_rereads_the_run_only_after_the_cache_interval(tmp_path: Path, clock: Clock) -> None:
    registry = CollectorRegistry()
    store = Store()
    GoodputCollector(tmp_path, "j", store, cache=timedelta(seconds=2), clock=clock, registry=registry)
    assert scrape(registry) == {}
    write_run(tmp_path, store)
    clock.now += 1.9
    assert scrape(registry) == {}  # still the cached answer
    clock.now += 0.1
    assert scrape(registry)[("megaheal_goodput_attempts_total", (("job", "j"),))] == 2


@pytest.mark.parametrize("corrupt", [
    pytest.param(lambda d, s: (d / "ranks" / "0.jsonl").write_bytes(b'{"step": 1, "ti\xff\xfe\n'), id="not-utf8"),
    pytest.param(lambda d, s: (d / "ranks" / "0.jsonl").write_text('{"step": 1, "time": "x", "step_seconds": 1}\n'),
                 id="wrong-type"),
    pytest.param(lambda d, s: ((d / "ranks" / "0.jsonl").unlink(), (d / "ranks" / "0.jsonl").mkdir()),
                 id="unreadable"),
    pytest.param(lambda d, s: setattr(s, "down", True), id="database-down"),
])
def test_a_garbled_run_file_or_a_database_that_is_down_empties_the_page_and_warns_once(
        tmp_path: Path, clock: Clock, corrupt: object, caplog: pytest.LogCaptureFixture) -> None:
    store = write_run(tmp_path)
    corrupt(tmp_path, store)  # type: ignore[operator]
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "j", store, clock=clock, registry=registry)
    with caplog.at_level(logging.WARNING, logger="healer.ledger.metrics"):
        for _ in range(3):
            assert scrape(registry) == {}
            clock.now += 10  # past the cache: every scrape reads the files again
    assert len(caplog.records) == 1 and "unreadable" in caplog.records[0].getMessage()


def test_a_repaired_file_exports_again_and_a_later_breakage_warns_again(tmp_path: Path, clock: Clock,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    store = write_run(tmp_path)
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "j", store, clock=clock, registry=registry)
    with caplog.at_level(logging.WARNING, logger="healer.ledger.metrics"):
        for _ in range(2):
            store.down = True
            assert scrape(registry) == {}
            store.down = False
            clock.now += 10
            assert scrape(registry)[("megaheal_goodput_attempts_total", (("job", "j"),))] == 2
            clock.now += 10
    assert len(caplog.records) == 2  # the same error, but a new episode of it


def test_a_second_collector_of_the_same_names_is_rejected(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "a", Store(), registry=registry)
    with pytest.raises(DuplicateTimeseries):
        GoodputCollector(tmp_path, "b", Store(), registry=registry)


@pytest.mark.parametrize("kwargs", [{"job": ""}, {"job": "a\nb"}, {"job": "j", "cache": timedelta(seconds=-1)}])
def test_it_refuses_a_bad_job_name_or_negative_cache(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GoodputCollector(tmp_path, incidents=Store(), **kwargs)  # type: ignore[arg-type]


# ---- the ETTR objective and the burn-rate counters ------------------------------------------------------------

def objective(got: dict[tuple[str, tuple[tuple[str, str], ...]], float], job: str = "j") -> tuple[float, float]:
    return got[("megaheal_ettr_target_ratio", (("job", job),))], got[("megaheal_ettr_window_seconds", (("job", job),))]


def counters(got: dict[tuple[str, tuple[tuple[str, str], ...]], float], job: str = "j") -> tuple[float, float]:
    """(elapsed, unproductive) seconds as served."""
    return (got[("megaheal_goodput_elapsed_seconds_total", (("job", job),))],
            got[("megaheal_goodput_unproductive_seconds_total", (("job", job),))])


def write_steps(run_dir: Path, journal: list[dict[str, object]], steps: list[tuple[int, float, float]]) -> None:
    """The attempts' journal and rank 0's records: (step, end time, seconds) each."""
    write(run_dir / "supervisor" / "attempts.jsonl", journal)
    write(run_dir / "ranks" / "0.jsonl", [{"step": s, "time": t, "step_seconds": d, "phases": {}} for s, t, d in steps])


FIRST_SIX = [(s, 11.0 + s, 1.0) for s in range(6)]
"""Steps 0..5 of attempt 0, 1 s each from 10 (10 s of startup before them)."""


def test_it_serves_the_jobs_ettr_objective_with_the_ledger(tmp_path: Path) -> None:
    store = write_run(tmp_path)
    default, chosen = CollectorRegistry(), CollectorRegistry()
    GoodputCollector(tmp_path, "j", store, registry=default)
    GoodputCollector(tmp_path, "j", store, registry=chosen,
                     cfg=GoodputCollector.Config(ettr_target=0.9, ettr_window=timedelta(days=14)))
    assert objective(scrape(default)) == (0.95, 7 * 86400.0)
    assert objective(scrape(chosen)) == (0.9, 14 * 86400.0)


@pytest.mark.parametrize(("cfg", "said"), [
    ({"ettr_target": 1.0}, "ettr_target must be a fraction > 0 and < 1"),
    ({"ettr_target": 0.0}, "ettr_target must be a fraction > 0 and < 1"),
    ({"ettr_target": 95.0}, "ettr_target must be a fraction > 0 and < 1 (0.95 is 95%), got 95.0"),
    ({"ettr_target": float("nan")}, "ettr_target must be a fraction > 0 and < 1"),
    ({"ettr_window": timedelta(0)}, "ettr_window must be > 0, got 0:00:00"),
    ({"ettr_window": timedelta(hours=-1)}, "ettr_window must be > 0"),
])
def test_an_objective_out_of_range_is_refused_naming_its_key(cfg: dict[str, object], said: str) -> None:
    with pytest.raises(ValueError, match=r"^" + re.escape(said)):
        GoodputCollector.Config(**cfg)  # type: ignore[arg-type]


def test_an_objective_in_a_mapping_with_an_unknown_key_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'ettr_taget'; valid keys: ettr_target, ettr_window"):
        from_mapping(GoodputCollector.Config, {"ettr_taget": 0.9}, "ettr")
    loaded = from_mapping(GoodputCollector.Config, {"ettr_target": 0.99, "ettr_window": "30d"}, "ettr")
    assert loaded == GoodputCollector.Config(ettr_target=0.99, ettr_window=timedelta(days=30))


START = [{"event": "start", "attempt": 0, "at": 0.0}]


def test_its_counters_start_at_0_at_its_first_step_and_count_seconds_passed_and_those_not_productive(
        tmp_path: Path, clock: Clock) -> None:
    registry = CollectorRegistry()
    store = Store()
    GoodputCollector(tmp_path, "j", store, cache=timedelta(0), clock=clock, registry=registry)
    write_steps(tmp_path, START, [])
    clock.now = 10.0  # NOTE: the collector's clock set to the run's times, so the numbers read the same
    assert "megaheal_goodput_wall_seconds" in {name for name, _ in scrape(registry)}
    assert not any(name.startswith(("megaheal_goodput_elapsed", "megaheal_ettr")) for name, _ in scrape(registry))
    write_steps(tmp_path, START, FIRST_SIX)
    clock.now = 16.0
    assert counters(scrape(registry)) == (0.0, 0.0)  # from its first step: the 10 s of startup are before
    write_steps(tmp_path, START, [*FIRST_SIX, (6, 17.0, 1.0), (7, 18.0, 1.0)])
    clock.now = 18.0
    assert counters(scrape(registry)) == (2.0, 0.0)
    # Attempt 0 dies after step 7 and is restarted at 20. Nothing is written between the attempt's start and its
    # first step, so the ledger's wall stands at 20; the counters go on with the clock.
    store.incidents = [{"id": 1, "kind": "crash", "attempt": 0, "detected_at": 19.0, "decided_at": 19.5,
                        "remediated_at": 20.0, "state": "resolved"}]
    restarted = [*START, {"event": "end", "attempt": 0, "at": 18.5}, {"event": "start", "attempt": 1, "at": 20.0}]
    write_steps(tmp_path, restarted, [*FIRST_SIX, (6, 17.0, 1.0), (7, 18.0, 1.0)])
    clock.now = 21.0
    got = scrape(registry)
    assert got[("megaheal_goodput_wall_seconds", (("job", "j"),))] == 20.0 and counters(got) == (5.0, 3.0)
    # Attempt 1 runs steps 4..7 again from a checkpoint, quicker (0.5 s a step): their first runs are lost work, so the
    # ledger's productive seconds fall, 8 to 6, and the unproductive seconds grow by more than the time that passed.
    write_steps(tmp_path, restarted, [*FIRST_SIX, (6, 17.0, 1.0), (7, 18.0, 1.0),
                                      *((s, 21.0 + (s - 3) * 0.5, 0.5) for s in range(4, 8))])
    clock.now = 23.0
    got = scrape(registry)
    assert got[("megaheal_goodput_seconds", (("category", "productive"), ("job", "j")))] == pytest.approx(6.0)
    assert counters(got) == (pytest.approx(7.0), pytest.approx(7.0))


def test_its_unproductive_counter_never_decreases_when_the_ledger_gives_time_back(tmp_path: Path,
                                                                                  clock: Clock) -> None:
    registry = CollectorRegistry()
    store = Store()
    GoodputCollector(tmp_path, "j", store, cache=timedelta(0), clock=clock, registry=registry)
    write_steps(tmp_path, START, FIRST_SIX)
    clock.now = 16.0
    assert counters(scrape(registry)) == (0.0, 0.0)
    # A straggler is detected at 18 while the job trains on: until the records of steps 6 and 7 arrive, 16-18 is
    # unproductive (the incident's detection); then it is theirs (productive).
    store.incidents = [{"id": 1, "kind": "straggler", "attempt": 0, "detected_at": 18.0, "state": "open"}]
    clock.now = 18.0
    assert counters(scrape(registry)) == (2.0, 2.0)
    write_steps(tmp_path, START, [*FIRST_SIX, (6, 17.0, 1.0), (7, 18.0, 1.0)])
    clock.now = 18.5
    assert counters(scrape(registry)) == (2.5, 2.0)  # held, not 0.5: a counter that fell would be read as a reset
    write_steps(tmp_path, START, [*FIRST_SIX, *((s, 11.0 + s, 1.0) for s in range(6, 10))])
    clock.now = 20.0
    assert counters(scrape(registry)) == (4.0, 2.0)  # the 2 s it over-counts are taken from what comes next
    write_steps(tmp_path, [*START, {"event": "end", "attempt": 0, "at": 25.0}],
                [*FIRST_SIX, *((s, 11.0 + s, 1.0) for s in range(6, 10))])
    clock.now = 25.0
    assert counters(scrape(registry)) == (9.0, 5.0)  # exact again: 5 s of teardown since its first look


def test_a_program_without_step_records_serves_its_ledger_but_is_not_judged(tmp_path: Path, clock: Clock) -> None:
    registry = CollectorRegistry()
    GoodputCollector(tmp_path, "j", Store(), cache=timedelta(0), clock=clock, registry=registry)
    write_steps(tmp_path, [*START, {"event": "end", "attempt": 0, "at": 3600.0}], [])  # an hour, no step
    clock.now = 3600.0
    got = scrape(registry)
    assert got[("megaheal_goodput_ettr_ratio", (("job", "j"),))] == 0.0  # what the ledger can say: nothing productive
    assert not any(name.startswith(("megaheal_goodput_elapsed", "megaheal_goodput_unproductive", "megaheal_ettr"))
                   for name, _ in got)


def test_its_counters_go_on_over_a_ledger_that_could_not_be_read(tmp_path: Path, clock: Clock) -> None:
    registry = CollectorRegistry()
    store = write_run(tmp_path)  # ends at 33 with a hang open
    GoodputCollector(tmp_path, "j", store, cache=timedelta(0), clock=clock, registry=registry)
    clock.now = 33.0
    first = scrape(registry)
    assert counters(first) == (0.0, 0.0) and objective(first) == (0.95, 7 * 86400.0)
    store.down = True
    clock.now = 43.0
    assert scrape(registry) == {}  # the whole page, counters and objective included
    store.down = False
    clock.now = 53.0
    assert counters(scrape(registry)) == (20.0, 20.0)  # the hung job trained no step meanwhile


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


def test_the_server_serves_the_ledger_on_a_free_loopback_port_and_stops_cleanly(tmp_path: Path) -> None:
    store = write_run(tmp_path)
    threads_before = set(threading.enumerate())
    server = GoodputServer(tmp_path, "llama-8b", store)
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
    server = GoodputServer(tmp_path, "j", Store())
    server.start()
    try:
        assert samples(fetch(server.url)) == {}
    finally:
        server.stop()


def test_the_server_refuses_a_port_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="port"):
        GoodputServer(tmp_path, "j", Store(), port=70000)
