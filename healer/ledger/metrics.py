"""The goodput ledger of a supervised run, served as Prometheus metrics while the run goes on.

`healer.ledger.goodput.compute` answers "where did the wall time go?" from the files a run leaves on disk, but only
when someone runs `megaheal report`. Served at /metrics (`megaheal run --metrics-port`), the same ledger can be
graphed and alerted on during the run: ETTR falling, restart time piling up, an incident stuck open.

Series (all labelled `job`):

    megaheal_goodput_seconds{category}       gauge: wall time per goodput.CATEGORIES (they sum to the wall)
    megaheal_goodput_wall_seconds            gauge: first attempt's start to the last thing the run wrote
    megaheal_goodput_ettr_ratio              gauge: productive / wall
    megaheal_goodput_steps                   gauge: steps that count (the last run of each step index)
    megaheal_goodput_lost_steps_total        counter: steps run and then run again after a restart
    megaheal_goodput_attempts_total          counter: attempts the launcher started
    megaheal_goodput_elapsed_seconds_total   counter: seconds this collector served the run since its first step
    megaheal_goodput_unproductive_seconds_total  counter: of those, the ones not productive (never decreases)
    megaheal_incidents{kind,state}           gauge: incidents of this run by kind and latest state
    megaheal_ettr_target_ratio               gauge: the job's ETTR objective (GoodputCollector.Config.ettr_target)
    megaheal_ettr_window_seconds             gauge: the window it is judged over (ettr_window)

The two counters are what the burn-rate rules divide over any window (deploy/prometheus/rules/recording.yml:
1 - ETTR over 5m .. 3d, against 1 - target); `_Seen` says why they are counted the way they are. They and the
objective are served once the ledger counts a step (never for a user's program: it writes no step records).

The ledger is recomputed from the files and the incidents in the healer's store at scrape time, at most once
per `cache` interval. Before the launcher has written its journal the page is empty; an unreadable or malformed
file, or a database that cannot be read, empties it too (with a warning, once per distinct error) instead of
failing the scrape.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from sqlalchemy.exc import SQLAlchemyError

from healer.errors import DatabaseError
from healer.ledger.goodput import CATEGORIES, Ledger, compute

log = logging.getLogger(__name__)
Incidents = Callable[[], list[dict[str, Any]]]
"""The run's incidents as healer.incidents.timeline payloads (read from the healer's store)."""

# NOTE: what a torn or hand-edited file makes `compute` raise (a missing key, a value of the wrong type, bytes
# that are not UTF-8, a path that cannot be read), and a store that cannot be read. Anything else is a bug in
# this code and should surface.
_UNREADABLE = (OSError, UnicodeDecodeError, KeyError, TypeError, AttributeError, SQLAlchemyError, DatabaseError)
_MAX_REMEMBERED_ERRORS = 32


class GoodputCollector(Collector):
    """The goodput ledger of one run directory, recomputed at scrape time (cached for `cache`), with the job's ETTR
    objective beside it."""

    @dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        """The job's ETTR objective (`megaheal run --ettr-target --ettr-window`; the run records it: healer/ledger/
        objective.py). On-call is paged when the job spends its error budget (1 - target of the window's wall time) too
        fast, not for each incident the healer heals."""

        ettr_target: float = 0.95
        """ETTR (productive / wall seconds) the job should reach over `ettr_window`, a fraction: 0 < target < 1."""
        ettr_window: timedelta = timedelta(days=7)
        """The rolling window the objective is judged over (> 0)."""

        def __post_init__(self) -> None:
            # NOTE: `not 0 < x < 1` also refuses NaN; 1 would leave no error budget to burn (a division by zero).
            if not 0 < self.ettr_target < 1:
                raise ValueError(f"ettr_target must be a fraction > 0 and < 1 (0.95 is 95%), got {self.ettr_target!r}")
            if self.ettr_window <= timedelta(0):
                raise ValueError(f"ettr_window must be > 0, got {self.ettr_window}")

    def __init__(self, run_dir: Path, job: str, incidents: Incidents, *, cache: timedelta = timedelta(seconds=2),
                 clock: Callable[[], float] = time.monotonic, registry: CollectorRegistry | None = None,
                 cfg: Config | None = None) -> None:
        if not job or not job.isprintable():
            raise ValueError(f"job must be a non-empty printable name, got {job!r}")
        if cache < timedelta(0):
            raise ValueError(f"cache must be >= 0, got {cache}")
        self._run_dir, self._job, self._incidents = Path(run_dir), job, incidents
        self.cfg = cfg or GoodputCollector.Config()
        self._cache_s, self._clock = cache.total_seconds(), clock
        self._lock = threading.Lock()  # NOTE: the HTTP server scrapes from one thread per request
        self._cached: tuple[float, Ledger | None] | None = None
        self._seen: _Seen | None = None
        self._logged: set[str] = set()
        if registry is not None:
            registry.register(self)

    def ledger(self) -> Ledger | None:
        """The current ledger, or None while there is none to serve."""
        return self._current()[0]

    def _current(self) -> tuple[Ledger | None, _Seen | None]:
        """The ledger and the counters as of it, together (one scrape serves both from the same ledger)."""
        with self._lock:
            now = self._clock()
            if self._cached is None or now - self._cached[0] >= self._cache_s:
                ledger = self._compute()
                if ledger is not None and self._seen is not None:
                    self._seen = self._seen.after(ledger, now)
                elif ledger is not None and ledger.steps_done > 0:
                    self._seen = _Seen.first(ledger, now)
                self._cached = (now, ledger)
            return self._cached[1], self._seen

    def _compute(self) -> Ledger | None:
        try:
            ledger = compute(self._run_dir, self._incidents())
        except _UNREADABLE as exc:  # before ValueError: UnicodeDecodeError is one
            self._warn_once(exc)
            return None
        except ValueError as exc:
            log.debug("no goodput ledger yet: %s", exc)  # no attempts' journal yet
            return None
        self._logged.clear()  # a later breakage is news again
        return ledger

    def _warn_once(self, exc: Exception) -> None:
        key = f"{type(exc).__name__}: {exc}"
        if key in self._logged:
            return
        if len(self._logged) >= _MAX_REMEMBERED_ERRORS:
            self._logged.clear()
        self._logged.add(key)
        log.warning("goodput metrics of %s left out: a run file is unreadable (%s)", self._run_dir, key,
                    exc_info=exc)

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so the registry can reject a second collector of the same names."""
        return _families(self._job, None, None, self.cfg)

    def collect(self) -> Iterator[Metric]:
        ledger, seen = self._current()
        return _families(self._job, ledger, seen, self.cfg) if ledger is not None else iter(())


@dataclass(frozen=True, slots=True)
class _Seen:
    """What this collector has seen of the run since it first saw a step: the seconds that passed (its own clock) and,
    of those, the highest count of unproductive ones (passed less the productive seconds the ledger gained).

    NOTE: why the counters are counted so:
    - seconds passed, not the ledger's wall: the ledger's wall ends at the last thing the run wrote, so it stands
      still through a restart or an attempt's startup and then jumps. Counted on the clock, a job that keeps failing
      to train burns evenly, and the short windows of the burn-rate alerts do not go quiet between two jumps;
    - unproductive seconds, not productive ones: a step run again after a restart from an older checkpoint turns its
      first run into lost work as the re-run takes its place, so the ledger's productive seconds stand still while
      steps are run again and fall where a re-run is quicker than its first run. A productive-seconds counter would
      fall (Prometheus reads that as a reset and counts the whole value again); the unproductive seconds grow then;
    - the highest count: the ledger credits a step when its record is written, so the step in flight counts as
      unproductive until then, and an incident detected while steps ran is detection until their records arrive.
      The counter keeps its highest value and the seconds that turn out productive are taken from the unproductive
      ones that come next: it over-counts by at most the longest such wait (a step, a late record), never more, and
      over-counting pages a little early, never late;
    - from 0, from the first step this collector saw: a healer that takes the run over starts a new process whose
      counters fall to 0 together, which Prometheus reads as a reset, exact for two counters that start at 0
      together (started at the ledger's totals, one could come back a little lower than it was, and its reset would
      count the run's whole unproductive time in one scrape: a page for nothing). The time before is in the ledger's
      gauges and the report, not in the counters: the first attempt's startup, and the gap while no healer served;
    - only once the ledger counts a step: a user's program (`megaheal run SCRIPT.py`) writes no step records
      (docs/your-trainer.md), so its productive time is unknown, not 0; its objective is not served and it is not
      judged (it would burn at the most its budget allows, every second unproductive)."""

    since: float
    """The collector's clock at the first ledger with a step."""
    first_productive: float
    passed: float
    """Seconds since `since`, at the latest ledger."""
    unproductive: float

    @staticmethod
    def first(ledger: Ledger, now: float) -> _Seen:
        return _Seen(now, _productive(ledger), 0.0, 0.0)

    def after(self, ledger: Ledger, now: float) -> _Seen:
        passed = max(self.passed, now - self.since)
        unproductive = passed - (_productive(ledger) - self.first_productive)
        return _Seen(self.since, self.first_productive, passed, max(self.unproductive, unproductive))


def _productive(ledger: Ledger) -> float:
    seconds = ledger.seconds.get("productive", 0.0)
    return seconds if math.isfinite(seconds) else 0.0


def _families(job: str, ledger: Ledger | None, seen: _Seen | None,
              cfg: GoodputCollector.Config) -> Iterator[Metric]:
    seconds = GaugeMetricFamily("megaheal_goodput_seconds", "Wall time of the run by goodput category (they sum "
                                "to megaheal_goodput_wall_seconds).", labels=["job", "category"], unit="seconds")
    wall = GaugeMetricFamily("megaheal_goodput_wall_seconds", "Wall time of the run so far: first attempt's start "
                             "to the last attempt's end or step.", labels=["job"], unit="seconds")
    ettr = GaugeMetricFamily("megaheal_goodput_ettr_ratio", "Effective training time ratio: productive seconds / "
                             "wall seconds.", labels=["job"], unit="ratio")
    steps = GaugeMetricFamily("megaheal_goodput_steps", "Training steps done that count (the last run of each "
                              "step index).", labels=["job"])
    lost = CounterMetricFamily("megaheal_goodput_lost_steps", "Steps run and then run again after a restart from "
                               "an older checkpoint.", labels=["job"])
    attempts = CounterMetricFamily("megaheal_goodput_attempts", "Attempts the launcher started.", labels=["job"])
    incidents = GaugeMetricFamily("megaheal_incidents", "Incidents of the run, by kind and latest state.",
                                  labels=["job", "kind", "state"])
    # NOTE: names of their own: a counter megaheal_goodput_wall_seconds would share its family name with the gauge.
    elapsed = CounterMetricFamily("megaheal_goodput_elapsed_seconds", "Seconds this healer has served the run since "
                                  "it saw its first step (rate() or increase() over a window: the window's wall time).",
                                  labels=["job"], unit="seconds")
    unproductive = CounterMetricFamily("megaheal_goodput_unproductive_seconds", "Of "
                                       "megaheal_goodput_elapsed_seconds_total, the seconds the ledger did not count "
                                       "productive (steps run again after a restart included); never decreases.",
                                       labels=["job"], unit="seconds")
    target = GaugeMetricFamily("megaheal_ettr_target_ratio", "The job's ETTR objective: productive / wall seconds "
                               "over megaheal_ettr_window_seconds; its error budget is 1 - this.", labels=["job"],
                               unit="ratio")
    window = GaugeMetricFamily("megaheal_ettr_window_seconds", "The rolling window the job's ETTR objective is "
                               "judged over.", labels=["job"], unit="seconds")
    if ledger is not None:
        for category in CATEGORIES:
            seconds.add_metric([job, category], ledger.seconds.get(category, 0.0))
        wall.add_metric([job], ledger.wall_s)
        ettr.add_metric([job], ledger.ettr)
        steps.add_metric([job], ledger.steps_done)
        lost.add_metric([job], ledger.lost_steps)
        attempts.add_metric([job], ledger.attempts)
        for (kind, state), n in sorted(_by_kind_and_state(ledger.incidents).items()):
            incidents.add_metric([job, kind, state], n)
    if ledger is not None and seen is not None:
        elapsed.add_metric([job], round(seen.passed, 3))
        unproductive.add_metric([job], round(seen.unproductive, 3))
        target.add_metric([job], cfg.ettr_target)
        window.add_metric([job], cfg.ettr_window.total_seconds())
    return iter((seconds, wall, ettr, steps, lost, attempts, incidents, elapsed, unproductive, target, window))


def _by_kind_and_state(incidents: list[dict[str, Any]]) -> Counter[tuple[str, str]]:
    return Counter((str(i.get("kind", "unknown")), str(i.get("state", "unknown"))) for i in incidents)


class GoodputServer:
    """/metrics of one run's goodput on its own registry and HTTP server (loopback unless told otherwise).

        server = GoodputServer(run_dir, job, incidents, port=9472); port = server.start(); ...; server.stop()
    """

    def __init__(self, run_dir: Path, job: str, incidents: Incidents, *, host: str = "127.0.0.1", port: int = 0,
                 cache: timedelta = timedelta(seconds=2), cfg: GoodputCollector.Config | None = None) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be 0 (any free port) to 65535, got {port}")
        self.host, self._port = host, port
        self.registry = CollectorRegistry()
        self.collector = GoodputCollector(run_dir, job, incidents, cache=cache, registry=self.registry, cfg=cfg)
        self._httpd: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Serve /metrics on a daemon thread; returns the bound port (the one picked when asked for 0)."""
        if self._httpd is not None:
            raise RuntimeError("goodput metrics server already started")
        self._httpd, self._thread = start_http_server(self._port, addr=self.host, registry=self.registry)
        return self.port

    @property
    def port(self) -> int:
        return int(self._httpd.server_port) if self._httpd is not None else self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and close the socket. Idempotent."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd, self._thread = None, None
