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
    megaheal_incidents{kind,state}           gauge: incidents of this run by kind and latest state

The ledger is recomputed from the files and the incidents in the healer's store at scrape time, at most once
per `cache` interval. Before the launcher has written its journal the page is empty; an unreadable or malformed
file, or a database that cannot be read, empties it too (with a warning, once per distinct error) instead of
failing the scrape.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
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
    """The goodput ledger of one run directory, recomputed at scrape time (cached for `cache`)."""

    def __init__(self, run_dir: Path, job: str, incidents: Incidents, *, cache: timedelta = timedelta(seconds=2),
                 clock: Callable[[], float] = time.monotonic, registry: CollectorRegistry | None = None) -> None:
        if not job or not job.isprintable():
            raise ValueError(f"job must be a non-empty printable name, got {job!r}")
        if cache < timedelta(0):
            raise ValueError(f"cache must be >= 0, got {cache}")
        self._run_dir, self._job, self._incidents = Path(run_dir), job, incidents
        self._cache_s, self._clock = cache.total_seconds(), clock
        self._lock = threading.Lock()  # NOTE: the HTTP server scrapes from one thread per request
        self._cached: tuple[float, Ledger | None] | None = None
        self._logged: set[str] = set()
        if registry is not None:
            registry.register(self)

    def ledger(self) -> Ledger | None:
        """The current ledger, or None while there is none to serve."""
        with self._lock:
            now = self._clock()
            if self._cached is None or now - self._cached[0] >= self._cache_s:
                self._cached = (now, self._compute())
            return self._cached[1]

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
        return _families(self._job, None)

    def collect(self) -> Iterator[Metric]:
        ledger = self.ledger()
        return _families(self._job, ledger) if ledger is not None else iter(())


def _families(job: str, ledger: Ledger | None) -> Iterator[Metric]:
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
    return iter((seconds, wall, ettr, steps, lost, attempts, incidents))


def _by_kind_and_state(incidents: list[dict[str, Any]]) -> Counter[tuple[str, str]]:
    return Counter((str(i.get("kind", "unknown")), str(i.get("state", "unknown"))) for i in incidents)


class GoodputServer:
    """/metrics of one run's goodput on its own registry and HTTP server (loopback unless told otherwise).

        server = GoodputServer(run_dir, job, incidents, port=9472); port = server.start(); ...; server.stop()
    """

    def __init__(self, run_dir: Path, job: str, incidents: Incidents, *, host: str = "127.0.0.1", port: int = 0,
                 cache: timedelta = timedelta(seconds=2)) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be 0 (any free port) to 65535, got {port}")
        self.host, self._port = host, port
        self.registry = CollectorRegistry()
        self.collector = GoodputCollector(run_dir, job, incidents, cache=cache, registry=self.registry)
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
