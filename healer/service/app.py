"""`megaheal healer`: wire the configuration, database, rules, sinks, scheduler and HTTP API together and serve.

Start-up: the schema is checked first. An empty database is created through the migrations; one at an older
revision is refused (exit 2, saying to run `megaheal db upgrade`); an unreachable one is not fatal: the API
starts, /readyz says why it is not ready, and the probe retries until the database answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from apscheduler.events import EVENT_JOB_ERROR, JobExecutionEvent
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette

from ground.httpclient import RequestFailed
from ground.secretfile import forbid_inspection, read_secret
from ground.typedconfig import ConfigError
from healer.compose import compose
from healer.decide.catalogue import fault
from healer.decide.promql import PrometheusClient, PromqlEvaluator
from healer.decide.rules import RuleSet, load_rule_set
from healer.errors import DatabaseError, DatabaseNotAtHead
from healer.incidents.db import default_db_url, ensure_schema, make_engine, safe_url
from healer.incidents.metrics import HealerMetrics
from healer.incidents.store import IncidentStore
from healer.oncall.sinks import AlertmanagerSink, GrafanaSink, Sink, Sinks, WebhookSink
from healer.pages.views import Sources
from healer.service.config import HealerConfig, read_db_password, read_token, split_listen
from healer.service.detection_first import DetectionFirst
from healer.service.diagnosis import LocalRunbookDiagnoser
from healer.service.pages import page_routes

log = logging.getLogger(__name__)


def build_sinks(cfg: HealerConfig) -> Sinks:
    sinks: list[Sink] = [AlertmanagerSink(url, cfg.base_url, cfg.alertmanager_resend, cfg.runbook_base)
                         for url in cfg.alertmanager_urls]
    webhook_token = read_secret(cfg.webhook_token_file, "webhook token") if cfg.webhook_token_file else None
    sinks += [WebhookSink(url, webhook_token) for url in cfg.webhook_urls]
    if cfg.grafana_url:
        if not cfg.grafana_token_file:
            raise ValueError("grafana_url needs grafana_token_file (a service-account token)")
        sinks.append(GrafanaSink(cfg.grafana_url, read_secret(cfg.grafana_token_file, "Grafana token")))
    return Sinks(sinks)


def notify_only(rules: RuleSet) -> RuleSet:
    """The service alone has no launcher: it refuses a rule that names a remedy acting on the job (only `megaheal
    run`, which starts the job, can restart it), and says which rules' faults it can only notify about."""
    acting = rules.job_actions()
    if acting:
        listed = "; ".join(f"{r.name} ({r.source}): remediate: {r.remediate}" for r in acting)
        raise ConfigError(f"this healer has no launcher, so it can only notify or escalate; these rules act on the "
                          f"job: {listed}. Use `megaheal run` for a job it should heal, or remediate: notify")
    defaulted = [r.name for r in rules.rules if r.remedy is None and fault(r.incident_kind).remedy.restarts]
    if defaulted:
        log.warning("no launcher: rules %s would restart the job under `megaheal run`; this healer notifies only",
                    ", ".join(defaulted))
    return rules


class Service:
    def __init__(self, cfg: HealerConfig) -> None:
        self.cfg = cfg
        self.token, self.token_source = read_token(cfg.token_file)
        self.db_url = cfg.db or default_db_url()
        self.engine = make_engine(self.db_url, timeout=cfg.db_timeout, password=read_db_password(cfg.db_password_file))
        actor = cfg.instance or f"{socket.gethostname()}:{os.getpid()}"
        self.diagnoser = LocalRunbookDiagnoser(cfg.diagnosis_workers) if cfg.diagnosis == "local" else None
        self.metrics = HealerMetrics()
        self.detection_first = DetectionFirst(self.metrics.heartbeats_held, self.metrics.heartbeats_held_past_limit)
        core = compose(metrics=self.metrics, db=self.engine, store=IncidentStore(self.engine, actor),
                       rules=notify_only(load_rule_set(list(cfg.rules))), token=self.token, sinks=build_sinks(cfg),
                       diagnoser=self.diagnoser, resend=cfg.alertmanager_resend, db_timeout=cfg.db_timeout,
                       promql=PromqlEvaluator(PrometheusClient(cfg.prometheus_url)) if cfg.prometheus_url else None,
                       max_body=cfg.max_body_bytes, detection_first=self.detection_first)
        self.store, self.table, self.healer = core.store, core.table, core.healer
        self.readiness, self.app = core.readiness, core.app
        self.scheduler = BackgroundScheduler(executors={"default": ThreadPoolExecutor(4)},
                                             job_defaults={"coalesce": True, "max_instances": 1})
        self.scheduler.add_listener(self._job_failed, EVENT_JOB_ERROR)
        # One thread: cycles never overlap (each reads and updates the detectors' memory).
        self._detect_thread = futures.ThreadPoolExecutor(1, thread_name_prefix="megaheal-detect")
        # The incident and job pages (healer/service/pages.py), beside the API.
        self.app.router.routes.extend(page_routes(self.healer, self.readiness, self.token, Sources(
            engine=self.engine, run_roots=tuple(Path(r) for r in cfg.run_roots), grafana_url=cfg.grafana_url)))
        self.app.router.lifespan_context = self._lifespan
        self._started = False

    def check_database(self) -> None:
        """The start-up check: refuse an old schema (DatabaseNotAtHead); log an unreachable database and go on."""
        try:
            ensure_schema(self.engine)
        except DatabaseNotAtHead:
            raise
        except DatabaseError as exc:
            log.error("%s; serving anyway: /readyz reports it until the database answers", exc)
        self.readiness.on_ready.append(self._on_ready)
        self.readiness.probe()

    def _on_ready(self) -> None:
        self.healer.start()
        self._started = True

    def _guard(self, name: str, tick: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            if not (self.readiness.ready and self._started):
                return
            try:
                tick()
            except (SQLAlchemyError, DatabaseError) as exc:
                self.metrics.tick_errors.labels(name).inc()
                log.warning("%s tick: database error: %s", name, str(exc).splitlines()[0])
                self.readiness.probe()
        return run

    def _job_failed(self, event: JobExecutionEvent) -> None:
        self.metrics.tick_errors.labels(event.job_id).inc()

    def schedule(self) -> None:
        c, h = self.cfg, self.healer
        jobs: list[tuple[str, Callable[[], Any], timedelta]] = [
            ("respond", h.tick_respond, c.respond_interval),
            ("notify", h.tick_notify, c.notify_interval),
            ("housekeeping", lambda: h.tick_housekeeping(c.retention), timedelta(hours=1)),
        ]
        if h.promql is not None:
            jobs.append(("promql", h.tick_promql, c.promql_interval))
        for name, tick, every in jobs:
            self.scheduler.add_job(self._guard(name, tick), "interval", seconds=every.total_seconds(), id=name,
                                   name=name)
        self.scheduler.add_job(self.readiness.probe, "interval", seconds=c.probe_interval.total_seconds(), id="probe")

    async def _detect_forever(self) -> None:
        """Detection cycles, each on the detection thread (see Healer.evaluate_detectors): never on the event loop,
        which must keep taking heartbeats and answering /healthz however long a cycle over many ranks takes."""
        every = self.cfg.detect_interval.total_seconds()
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every)
            if not (self.readiness.ready and self._started):
                continue
            try:
                # NOTE: heartbeats wait while the cycle evaluates (healer/service/detection_first.py); the thread
                # reopens the gate itself as soon as the detectors are done, before the database writes.
                with self.detection_first.closed():
                    await loop.run_in_executor(self._detect_thread, self._detect_once,
                                               lambda: loop.call_soon_threadsafe(self.detection_first.open))
            except Exception:  # noqa: BLE001 - NOTE: this loop must outlive a bad cycle; the error is logged and counted
                self.metrics.tick_errors.labels("detect").inc()
                log.error("detection cycle failed", exc_info=True)

    def _detect_once(self, evaluated: Callable[[], object]) -> None:
        """One cycle, on the detection thread; `evaluated` is called once the detectors are done (however that
        went). NOTE: the view goes at the end, on this thread: freeing the heartbeats it held up is work too."""
        try:
            view, results = self.healer.evaluate_detectors()
        finally:
            evaluated()
        self._guard("detect", lambda: self.healer.apply_detections(view, results))()

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.schedule()
        self.scheduler.start()
        detect = asyncio.create_task(self._detect_forever(), name="megaheal-detect")
        log.info("megaheal healer on http://%s (database %s, %d rules, token from %s)", self.cfg.listen,
                 safe_url(self.db_url), len(self.healer.rules), self.token_source)
        try:
            yield
        finally:
            detect.cancel()
            self._detect_thread.shutdown(wait=False, cancel_futures=True)
            self.scheduler.shutdown(wait=False)
            if self.diagnoser is not None:
                self.diagnoser.shutdown()
            self.engine.dispose()

    def serve(self) -> None:
        import uvicorn

        from ground.http_serving import guarded_h11

        host, port = split_listen(self.cfg.listen)
        # NOTE: limit_concurrency counts open connections (idle keep-alive ones too) and running requests; past it
        # uvicorn answers 503 at once, so a flood of connections cannot take every file descriptor or worker.
        # A connection that sends no request within 10 s is closed, and one address may hold a quarter of the bound
        # at most (ground/http_serving.py): one client's idle connections no longer make every host look lost.
        bound = fit_open_files(self.cfg.max_connections)
        config = uvicorn.Config(self.app, host=host, port=port, access_log=False, log_config=None,
                                timeout_graceful_shutdown=5, limit_concurrency=bound,
                                http=guarded_h11(per_peer=max(1, bound // 4)))
        uvicorn.Server(config).run()


def fit_open_files(connections: int) -> int:
    """`connections`, after raising the soft limit of open files to make room for them (and the database pool,
    logs, runbooks); fewer, logged, when the hard limit is lower."""
    import resource

    need = connections + 128
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        if raised < need:
            log.warning("max_connections %d needs %d open files, the hard limit is %d: serving %d connections at most",
                        connections, need, hard, raised - 128)
            return max(8, raised - 128)
    return connections


def run(cfg: HealerConfig) -> int:
    """Build and serve; returns the exit code. Errors in configuration or schema end it with 2."""
    # NOTE: before any secret is read, so that same-uid processes (the ranks, on a node) cannot read this one's
    # memory or environment through /proc.
    forbid_inspection()
    try:
        service = Service(cfg)
        service.check_database()
    except DatabaseNotAtHead as exc:
        log.error("%s", exc)
        return 2
    except (DatabaseError, ValueError, RequestFailed, OSError) as exc:  # SecretError and ConfigError are ValueErrors
        log.error("cannot start: %s", exc)
        return 2
    service.serve()
    return 0
