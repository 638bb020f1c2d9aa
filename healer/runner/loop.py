"""`megaheal run`'s loop: the one healer (healer.engine.engine) embedded with the local launcher, healing the job it
started itself.

The node agents (one per host, healer/agent/) post their batches to the healer's endpoint (healer/runner/reports.py)
whenever they like; each tick (a quarter of a second) brings the coordinator up to date with what they reported,
detects, responds to the incidents that are due, and resolves the ones whose restart trained again. Nothing in a tick
waits: diagnoses and restarts run on the remediator's worker, notifications (Alertmanager) and the goodput ledger
on a thread of their own, so a slow runbook or an Alertmanager that does not answer never holds up detection.
The job ends `finished` (every step done), `escalated` (the healer stopped it and paged: its budget is spent, or
it cannot run smaller) or `timeout`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from ground.secretfile import replace_private
from healer.decide.policy import will_restart
from healer.decide.signals import from_rule
from healer.detect.suspects import on_hosts
from healer.decide.states import IncidentState
from healer.engine.engine import Healer
from healer.errors import DatabaseError
from healer.incidents import epochs
from healer.incidents.timeline import IncidentTimeline, job_timelines
from healer.launchers.agent_client import AgentClient, Fenced
from healer.launchers.coordinator import Coordinator
from healer.launchers.fleet import AgentFleet
from healer.launchers.remediator import AgentRemediator, wait_idle
from healer.observe.heartbeats import HeartbeatTable
from healer.runner.keeper import AgentKeeper
from healer.ports import TakenOver
from healer.runner.reports import ReportServer
from healer.runner.watch import Handover
from wire.run_paths import RunPaths

log = logging.getLogger(__name__)
S = IncidentState
OPEN_STATES = frozenset({S.OPEN, S.DIAGNOSING, S.REMEDIATING})
EPOCH_EVERY_S = 5.0
"""How often the loop reads the job's epoch in the database (a newer healer's claim fences this one off)."""


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    tick: timedelta = timedelta(seconds=0.25)
    """How often the loop looks."""
    notify_every: timedelta = timedelta(seconds=1)
    """How often incidents are synced to the sinks (Alertmanager)."""

    def __post_init__(self) -> None:
        if self.tick <= timedelta(0) or self.notify_every <= timedelta(0):
            raise ValueError("tick and notify_every must be > 0")


class SelfHealingJob:
    def __init__(self, healer: Healer, remediator: AgentRemediator, agents: AgentFleet, reports: ReportServer,
                 table: HeartbeatTable, cfg: LoopConfig | None = None,
                 background: list[Callable[[], object]] | None = None,
                 closing: list[Callable[[], object]] | None = None) -> None:
        """`background`: called every `notify_every` off the loop (the goodput ledger writer, say); `closing`: called
        last on close (the replica groups' Lighthouse)."""
        self.healer, self.remediator, self.agents, self.reports, self.table = healer, remediator, agents, reports, table
        self.keeper = AgentKeeper(agents, remediator.sup, table, self._hosts, remediator.token)
        self.cfg = cfg or LoopConfig()
        self.job = remediator.job
        self.outcome: str | None = None
        self._background: list[Callable[[], object]] = [healer.tick_notify, self._rescreen_due, *(background or [])]
        self._closing = list(closing or [])
        self._rescreen_at = time.monotonic() + self._rescreen_every_s()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._off_loop, name="megaheal-notify", daemon=True)
        self._epoch_read_at = -EPOCH_EVERY_S

    @property
    def sup(self) -> Coordinator:
        return self.remediator.sup

    def _hosts(self) -> list[str]:
        """The hosts that should have an agent now: the job's and its spares, not those it left out."""
        r = self.remediator
        return [n for n in dict.fromkeys([*r.nodes, *r.spares]) if n not in r.excluded]

    def _serve_reports(self) -> str:
        """Start the endpoint the agents report to; its URL, also left in the run directory for people's tools
        (`megaheal incidents --run-dir`): the port is chosen at start."""
        url = self.reports.start()
        replace_private(RunPaths(Path(self.sup.cfg.run_dir)).healer_url, url + "\n")
        return url

    def _start_agents(self) -> None:
        """The endpoint the agents report to, then an agent on every host (spares too: they report their GPUs)."""
        self.agents.healer_url = self._serve_reports()
        urls = self.agents.start([*self.remediator.cfg.nodes, *self.remediator.cfg.spares])
        token, tls = self.remediator.token, self.agents.healer_tls()
        self.sup.agents.update({n: AgentClient(n, url, token, tls=tls) for n, url in urls.items()})

    # ---- start ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self.healer.start()
        self.healer.jobs.touch_job(self.job)
        self.healer.jobs.touch_nodes([*self.remediator.nodes, *self.remediator.spares], self.job)
        self._start_agents()
        self.keeper.start()
        self.remediator.start()

    def _rescreen_every_s(self) -> float:
        every = self.remediator.cfg.rescreen_every
        return every.total_seconds() if every is not None and self.remediator.cfg.preflight else float("inf")

    def _rescreen_due(self) -> None:
        """The idle spares and the hosts left out screened again every rescreen_every (AgentRemediator.rescreen),
        where the run screens its hosts: a spare that broke while it waited is found before it is needed, a host
        repaired since it was left out is a spare again."""
        if time.monotonic() >= self._rescreen_at:
            self._rescreen_at = time.monotonic() + self._rescreen_every_s()
            self.remediator.rescreen()

    def take_over(self) -> list[int]:
        """Go on with a run whose previous healer died (`megaheal run --take-over`), instead of `start`: its agents outlived
        it and are adopted (told to report here); its last attempt is adopted where it still runs, else stopped; and
        the incidents it left in flight (in the store) are finished: an undecided one is decided now, a restart it had
        ordered is carried out again unless its attempt is the one that runs."""
        restarts = self.healer.jobs.restarts(self.job)
        excluded = {n for r in restarts for n in (r.excluded or [])}
        skip = {s for r in restarts for s in (r.skip_steps or [])}
        self.agents.healer_url = self._serve_reports()
        urls = self.agents.adopt([*self.remediator.cfg.nodes, *self.remediator.cfg.spares])
        tls = self.agents.healer_tls()
        self.sup.agents.update({n: AgentClient(n, url, self.remediator.token, tls=tls) for n, url in urls.items()})
        self.keeper.start()
        taken = self.remediator.take_over(excluded, skip)
        in_flight = self.healer.take_over(taken.attempt if taken.adopted else None)
        if taken.elsewhere:
            in_flight += self._lost_with_the_healer(taken)
        log.warning("taking over %s: %d incident(s) in flight; attempt %s %s", self.job, len(in_flight), taken.attempt,
                    "adopted (it still runs)" if taken.adopted else "stopped")
        if not taken.adopted and not self.remediator.busy and not self._restart_ordered():
            # Nothing in flight restarts the job: its last attempt was stopped, so start the next one. NOTE: the
            # healer's own doing, not the job's: it spends no restart budget.
            self.remediator.start_next(resume="auto")
        return in_flight

    def _lost_with_the_healer(self, taken: TakenOver) -> list[int]:
        """The last attempt ran on hosts this healer does not have: it runs in a successor job, the healer before it
        lost with its host (healer/runner/watch.py). Those hosts are lost: an incident of kind host_lost for them,
        with the watcher's account, leaves them out and restarts on this allocation's hosts (its spares now)."""
        rule = next((r for r in self.healer.rules.values() if r.incident_kind == "host_lost"), None)
        handover = Handover.read(Path(self.sup.cfg.run_dir))
        said = (f"Slurm job {handover.job_id} was ended by its watcher and goes on as job {handover.successor}"
                if handover is not None else "this healer runs in another allocation")
        gone = ", ".join(taken.elsewhere)
        if rule is None:
            # NOTE: no rule to open the incident with: the hosts are left out all the same, or nothing could start.
            log.error("hosts %s of attempt %s are not in this allocation (%s), and no rule of kind host_lost is "
                      "configured: replaced without an incident", gone, taken.attempt, said)
            self.remediator.replace_lost(taken.elsewhere)
            return []
        evidence = {"lost_with_the_healer": list(taken.elsewhere),
                    "handover": asdict(handover) if handover is not None else None}
        signal = from_rule(rule, {"key": f"{self.job}/{gone}"},
                           f"host {gone} lost with the healer that ran on it: {said}", evidence,
                           labels={"job": self.job, "node": taken.elsewhere[0]}, job=self.job,
                           node=taken.elsewhere[0], attempt=taken.attempt, suspects=on_hosts(taken.elsewhere))
        self.healer.report(signal)
        return [i.id for i in self.healer.store.of_job(self.job, OPEN_STATES) if i.kind == "host_lost"]

    def _restart_ordered(self) -> bool:
        """Whether an incident in flight restarts the job (a restart ordered, or one its decision will order)."""
        for incident in self.healer.store.of_job(self.job, OPEN_STATES):
            if self.healer.responder.restart_pending(incident.id):
                return True
            if will_restart(incident.kind, self.healer.rules.get(incident.rule), S(incident.state)):
                return True
        return False

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self, timeout: timedelta, on_tick: Callable[[SelfHealingJob], None] | None = None,
            interrupted: Callable[[], bool] = lambda: False, hurry: Callable[[], bool] = lambda: False) -> str:
        """Tick until the job finishes, escalates, `timeout` passes or `interrupted()` turns true; returns the outcome.

        However it ends (an error included), the job does not outlive it: a job still running is stopped on the way
        out (SIGTERM, then SIGKILL after the grace or as soon as `hurry()` is true), and no attempt starts after.
        Except when an agent refused this healer's epoch (Fenced, raised): a newer healer drives the job, which is
        left to it as it is."""
        deadline = time.monotonic() + timeout.total_seconds()
        self._thread.start()
        try:
            while self.outcome is None:
                if interrupted():
                    self.outcome = "interrupted"
                    break
                if time.monotonic() > deadline:
                    self.outcome = "timeout"
                    self.remediator.stop("the run timed out", timedelta(seconds=5))
                    break
                self.tick()
                if on_tick is not None:
                    on_tick(self)
                time.sleep(self.cfg.tick.total_seconds())
        finally:
            self.keeper.stop()  # the agents are the job's to end from here on
            fenced = self.sup.fence.by is not None
            if self.outcome in ("finished", "escalated", "timeout") and not fenced:
                wait_idle(self.remediator, 120)  # the healer's own last orders (a stop) are carried out first
            if fenced:
                self.sup.close()  # NOTE: nothing started, nothing stopped: the job is the newer healer's
            else:
                # NOTE: interrupted, or an exception on its way up: stop the job here, on this thread, instead of
                # waiting behind an order the worker may be busy with (a 90 s diagnosis).
                self.remediator.shutdown(hurry=hurry)
            wait_idle(self.remediator, 30)
            self._stop.set()
            self._thread.join(timeout=60)
            if not fenced:  # the newer healer notifies and keeps the ledger
                self._off_loop_once()
        return self.outcome

    def tick(self) -> None:
        # NOTE: first: an agent refused one of this healer's orders for its epoch (on whichever thread it went out):
        # a newer healer drives the job, and this one must stop acting on it rather than fight it.
        self.sup.fence.check()
        self.remediator.poll()
        try:
            self._check_epoch()
            view = self.healer.tick_detect()
            self.healer.tick_respond()
            self.healer.tick_recovery(view)
            self._grow_due()
        except (SQLAlchemyError, DatabaseError) as exc:
            # NOTE: the store is the healer's memory: without it nothing can be decided; the next tick tries again.
            log.warning("the healer's database failed this tick: %s", str(exc).splitlines()[0])
            return
        halted = self.healer.responder.halted
        if halted is not None and not self.remediator.busy:
            self.outcome = "escalated"
            return
        state = self.remediator.state()
        if state.succeeded and not self.remediator.busy:
            self._finished()
            self.outcome = "finished"

    def _grow_due(self) -> None:
        """A job that came back smaller grows back once spares are there again (AgentRemediator.grow): a planned
        change, not an incident, made only while the attempt trains and nothing else is being mended."""
        r = self.remediator
        target = r.grow_target()
        if target is None or r.busy or self.healer.responder.halted is not None:
            return
        a = self.sup.attempt
        if a is None or a.done or a.stopping or self.healer.store.of_job(self.job, OPEN_STATES):
            return
        # NOTE: last, as it reads rank 0's records: not training yet, a start that fails must be the crash detector's.
        if r.first_step(a.number) is None:
            return
        r.grow(*target)

    def _check_epoch(self) -> None:
        """Trip the fence when a newer healer claimed the job's epoch (every EPOCH_EVERY_S): its agents report to
        that one, so this one would soon see every host silent and act on a job it no longer drives."""
        now = time.monotonic()
        if now - self._epoch_read_at < EPOCH_EVERY_S:
            return
        self._epoch_read_at = now
        newest = epochs.current(self.healer.store.engine, self.job)
        if newest is not None and newest > self.sup.epoch:
            self.sup.fence.trip(Fenced(f"a newer healer claimed epoch {newest} of job {self.job} (this one's: "
                                       f"{self.sup.epoch})"))
            self.sup.fence.check()

    def _finished(self) -> None:
        """Every step is done: what still waits for its condition to clear (a straggler, say) cannot fault any more."""
        for incident in self.healer.store.of_job(self.job, OPEN_STATES):
            if self.healer.store.transition(incident.id, S(incident.state), S.RESOLVED,
                                            {"reason": "the job finished every step"}, next_action_at=None):
                self.healer.changed(incident.id, "transition", incident.state, S.RESOLVED.value)

    def _off_loop(self) -> None:
        while not self._stop.wait(self.cfg.notify_every.total_seconds()):
            self._off_loop_once()

    def _off_loop_once(self) -> None:
        for task in self._background:
            try:
                task()
            except Exception:  # noqa: BLE001 - NOTE: notifications and the ledger must never stop the healing
                log.warning("background task %s failed", getattr(task, "__qualname__", task), exc_info=True)

    def close(self) -> None:
        """Release what the healer holds (its worker, its agents, its endpoint, its database connections); the job's
        processes are over."""
        self.keeper.stop()
        self.remediator.close()
        self.agents.stop()
        self.reports.stop()
        self.healer.store.engine.dispose()
        for release in self._closing:
            release()

    # ---- reading ---------------------------------------------------------------------------------------

    def incidents(self) -> list[IncidentTimeline]:
        """The job's incidents, read back from the store."""
        return job_timelines(self.healer.store.engine, self.job)

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.healer.clock(), UTC)
