"""The discrete-event simulation of one job: it trains, its hosts fail, and every incident goes through the healer's
own policy (sim/decisions.py) stage by stage, each stage taking the time the config gives it.

    a failure on a host of the training job   the attempt stops; detection (sim/detection.py); then what the policy
                                              decides: a diagnosis (node-health, or node-health-live before a warm
                                              restart: it fails a broken host with the category's `found`
                                              chance), a restart (warm: the newest in-memory snapshot, a lost
                                              host's part from its peer's replica; cold: the newest durable
                                              checkpoint, the stop, the startup, the load), hosts left out
                                              (to repair, spares in), a rollback, a backoff, or a page
    a page                                    a person acts after Stages.person: broken hosts out, spares in, the
                                              job smaller by whole replicas if it must, a cold restart
    a failure while the job is down           its host is broken: the next attempt fails on it when it starts
    a failure of a spare                      the spare goes to repair
    a broken host kept in the job             it fails again after Failures.recur_after on average
    an sdc fault                              the trainer's re-run (Stages.rerun) judges it: transient, the step is
                                              mended and the host has a strike; persistent, or the strike that
                                              convicts, opens the host's sdc incident
    a planned interruption                    at a snapshot boundary, nothing lost: one warm restart (restart: warm
                                              or replica); cold: a clean stop, the maintenance, a cold start

Training between two interruptions is closed-form (sim/saves.py): snapshots every `snapshot_interval` of training
and saves every `interval` (every k-th snapshot is a save), each stalling it, so no event is needed per step or per
save. With `tuning.enabled` both intervals move at each attempt's start, by the healer's own rule
(healer/decide/save_interval.py), toward Daly's optimum for the failures seen. With `policy: false` every failure
costs one fixed restart instead (the analytic baseline of sim/analytic.py).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from healer.decide.catalogue import UNNAMED_KINDS, Remedy, fault
from healer.decide.plans import Verdict
from healer.decide.policy import LIVE_RUNBOOK, Action, Decision, page_now
from healer.decide.rules import RuleSet
from healer.decide.states import IncidentState
from sim.config import Category, SimConfig
from sim.decisions import JobSnapshot, SimIncident, at, decide_incident, rule_for
from sim.detection import detection_seconds, rule_params
from sim.fleet import Failure, Fleet, Where
from sim.groups import GroupLosses
from sim.ledger import Ledger
from sim.saves import SaveCadence, Segment
from wire.verdict import Status

S = IncidentState


@dataclass(slots=True)
class SimResult:
    config: dict[str, Any]
    wall_s: float
    ledger: Ledger
    failures: int
    failures_on_job: int
    incidents: Counter[str]
    remedies: Counter[str]
    restarts: Counter[str]
    pages: list[dict[str, Any]]
    spares_taken: int
    repairs: int
    lemons_left_out: int
    sim_seconds: float
    """How long the simulation itself ran (this machine's wall clock)."""
    events: int
    interval_changes: list[dict[str, Any]]
    """The tuned save interval's moves (tuning.enabled): when, from, to, and why."""

    @property
    def ettr(self) -> float:
        return self.ledger.ettr(self.wall_s)

    def to_payload(self) -> dict[str, Any]:
        return {"ettr": round(self.ettr, 5), "wall_days": round(self.wall_s / 86400.0, 3),
                "gpu_hours": self.ledger.gpu_hours(), "lost_gpu_hours_by_cause": self.ledger.causes_gpu_hours(),
                "failures": self.failures, "failures_on_job": self.failures_on_job,
                "incidents": dict(sorted(self.incidents.items())), "remedies": dict(sorted(self.remedies.items())),
                "restarts": dict(sorted(self.restarts.items())), "pages": len(self.pages),
                "page_reasons": self.pages, "spares_taken": self.spares_taken, "repairs": self.repairs,
                "lemons_left_out": self.lemons_left_out, "sim_seconds": round(self.sim_seconds, 3),
                "events": self.events, "interval_changes": self.interval_changes}


class Simulation(GroupLosses, SaveCadence):
    def __init__(self, cfg: SimConfig, rules: RuleSet, seed: int | None = None) -> None:
        self.cfg, self.rules = cfg, rules
        self.rng = np.random.default_rng(cfg.seed if seed is None else seed)
        job = cfg.job
        self.size, self.gpn, self.hpr = job.nodes, job.gpus_per_node, job.hosts_per_replica
        self.fleet = Fleet(cfg.failures, job.nodes, job.spares if cfg.policy else 0, self.rng)
        self._index = {n: i for i, n in enumerate(self.fleet.names)}
        self.detect = detection_seconds(rules, cfg)
        self.ledger = Ledger(gpus=job.gpus)
        self.end = cfg.days * 86400.0
        self.now = 0.0
        self.hosts: list[int] = list(range(job.nodes))
        self.dp = job.dp
        self.attempt = 0
        self.segment: Segment | None = None
        self.progress = 0.0
        """Training done (full-job seconds) when the job last stopped, or where it resumed."""
        self.memory = 0.0
        """The newest completed save: every rank holds it in memory (a warm restart resumes from it)."""
        self.durable: list[tuple[float, float]] = [(0.0, 0.0)]
        """(progress, when it is durable) of the saves, oldest first."""
        self.out: set[int] = set()
        """restart: replica: hosts of the job whose replica group was lost and is not back yet (they do not train)."""
        self._stall = 0
        """restart: replica: the survivors' stall in flight (a newer one, or a stop of the whole job, supersedes it)."""
        self.broken: dict[int, Category] = {}
        """Hosts of the job that are broken, and how: kept in the job, they fail again."""
        self.pending: dict[int, Category] = {}
        """Hosts that broke while the job was down: the next attempt fails on them as it starts."""
        self.recur_token: dict[int, int] = {}
        self.named: dict[int, list[float]] = {}
        """Host -> when incidents named it (the lemon limit's history)."""
        self.restart_times: list[float] = []
        self.unnamed_restart_times: list[float] = []  # those for a fault that names no host (the unscaled budget's)
        ck = cfg.checkpoint
        self.save_s = ck.interval.total_seconds()
        self.snap_s = (ck.snapshot_interval.total_seconds() if self._snapshots and ck.snapshot_interval is not None
                       else self.save_s)
        """The intervals the job runs at now (the tuning moves the one restarts resume from)."""
        self.lossy_restarts: list[float] = []
        """Training done (the job's own clock) at each restart of the whole job that lost work since a snapshot."""
        self.disk_restarts: list[float] = []
        """The same, of the restarts that resumed from a save (cold ones): what the saves' interval is tuned by."""
        self.interval_changes: list[dict[str, Any]] = []
        self.strikes: Counter[int] = Counter()
        """Host -> transient sdc verdicts against it (convicted at the rule's convict_after)."""
        self.last_restart_warm_untrained = False
        self.down: tuple[str, float, str | None] | None = ("restart", 0.0, None)
        """(ledger category, since, failure category) of the time the job is not training; the first start is a
        restart like any other (a cold start of its own)."""
        self.events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._ids = itertools.count(1)
        self.n_events = 0
        self.failures = self.failures_on_job = self.spares_taken = self.repairs = self.lemons_left_out = 0
        self.incidents: Counter[str] = Counter()
        self.remedies: Counter[str] = Counter()
        self.restarts: Counter[str] = Counter()
        self.pages: list[dict[str, Any]] = []
        self.u0 = self._analytic_restart_s()
        self._analytic_token = 0
        """policy: false: the restart in flight (a failure during one starts it again)."""

    # ---- the loop ---------------------------------------------------------------------------------------------

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        first = self.fleet.next_failure(0.0)
        self._push(first.at, "fail", first)
        if self.cfg.policy and self.cfg.failures.planned > 0:
            self._push(self._next_planned(0.0), "planned", None)
        self._push(self._cold_time(), "trained", None)
        while self.events:
            at, _, what, data = heapq.heappop(self.events)
            if at >= self.end:
                break
            self.now = at
            self.n_events += 1
            getattr(self, f"_on_{what}")(data)
        self.now = self.end
        self._close_training(self.end)
        self._close_down(self.end)
        self.ledger.add("productive", self.progress * self.ledger.gpus)
        self.ledger.check(self.end)
        return SimResult(config=self._summary(), wall_s=self.end, ledger=self.ledger, failures=self.failures,
                         failures_on_job=self.failures_on_job, incidents=self.incidents, remedies=self.remedies,
                         restarts=self.restarts, pages=self.pages, spares_taken=self.spares_taken,
                         repairs=self.repairs, lemons_left_out=self.lemons_left_out,
                         sim_seconds=time.perf_counter() - t0, events=self.n_events,
                         interval_changes=self.interval_changes)

    def schedule(self, failure: Failure) -> None:
        """A failure at a time of the caller's choosing, beside the drawn ones (tests, what-ifs); before run()."""
        self._push(failure.at, "injected", failure)

    def _push(self, at: float, what: str, data: Any) -> None:
        heapq.heappush(self.events, (at, next(self._seq), what, data))

    # ---- training: sim/saves.py (SaveCadence) -----------------------------------------------------------------

    def _step(self, progress: float) -> int:
        return int(progress // self.cfg.job.step_time.total_seconds())

    # ---- down time -------------------------------------------------------------------------------------------

    def _down_as(self, category: str, cause: str | None) -> None:
        """The job waits from now on, as `category` (the previous wait closed into the ledger)."""
        self._close_down(self.now)
        self.down = (category, self.now, cause)

    def _close_down(self, t: float) -> None:
        if self.down is None:
            return
        category, since, cause = self.down
        self.ledger.add(category, (t - since) * self.ledger.gpus, cause)
        self.down = None

    def _lose(self, resume: float, cause: str) -> None:
        """Resume from `resume`: the training since it is lost work."""
        if resume > self.progress + 1e-6:
            raise AssertionError(f"resuming at {resume} ahead of the training done, {self.progress}")
        self.ledger.add("lost_work", (self.progress - resume) * self.ledger.gpus, cause)
        self.progress = resume
        # Saves of the lost stretch (one still being written when the attempt died) are gone with it.
        self.durable = [(p, ready) for p, ready in self.durable if p <= resume]

    # ---- failures --------------------------------------------------------------------------------------------

    def _on_fail(self, f: Failure) -> None:
        """The fleet's failure process: this failure, and the next one drawn."""
        nxt = self.fleet.next_failure(self.now)
        self._push(nxt.at, "fail", nxt)
        self._failure(f)

    def _on_injected(self, f: Failure) -> None:
        self._failure(f)

    def _failure(self, f: Failure) -> None:
        where = Where(self.fleet.where[f.host])
        if where is Where.REPAIR:
            return  # thinned: a host in repair does not fail
        self.failures += 1
        if where is Where.SPARE:
            self._to_repair(f.host, f.category)
            return
        self.failures_on_job += 1
        if not self.cfg.policy:
            self._analytic_failure(f)
            return
        if self.segment is None:
            # NOTE: while the job is down a broken host only waits: the next attempt fails on it when it starts.
            if f.category.host_at_fault and f.host not in self.broken:
                self.pending[f.host] = f.category
            return
        if f.category.host_at_fault:
            self.broken[f.host] = f.category
        self._interrupted(f.host, f.category)

    def _on_recur(self, data: tuple[int, int]) -> None:
        host, token = data
        cat = self.broken.get(host)
        if cat is None or self.recur_token.get(host) != token or self.segment is None:
            return
        self.failures += 1
        self.failures_on_job += 1
        self._interrupted(host, cat)

    def _recur(self, host: int, cat: Category) -> None:
        token = self.recur_token[host] = self.recur_token.get(host, 0) + 1
        again = self.fleet.recurrence(self.now, host, cat)
        self._push(again.at, "recur", (host, token))

    def _to_repair(self, host: int, cat: Category) -> None:
        self.fleet.where[host] = Where.REPAIR
        self.broken.pop(host, None)
        self.pending.pop(host, None)
        self.recur_token.pop(host, None)
        self.repairs += 1
        self._push(self.now + cat.repair.total_seconds(), "repaired", host)

    def _on_repaired(self, host: int) -> None:
        if self.fleet.where[host] == Where.REPAIR:
            self.fleet.where[host] = Where.SPARE

    # ---- incidents -------------------------------------------------------------------------------------------

    def _kind(self, cat: Category) -> str:
        """What the healer sees of a failure of `cat`: an sdc fault is a NaN under replica groups (no re-run there)."""
        return "nonfinite" if cat.sees == "sdc" and self.cfg.restart == "replica" else cat.sees

    def _interrupted(self, host: int, cat: Category) -> None:
        """A failure stops the training attempt: its incident begins. A job of replica groups loses only the group
        of the host (restart: replica), where the policy would replace it alone. An sdc fault the re-run judges
        transient is mended in place (a strike against the host); a persistent one, or the strike that convicts,
        opens the host's sdc incident."""
        if host in self.out:
            return  # its group is out already: the incident that took it out answers this too
        if self._kind(cat) == "sdc" and not self._convicted(host, cat):
            self.incidents["sdc_mended"] += 1
            self._pause(self.cfg.stages.rerun.total_seconds(), cat.name)
            return
        if self._replica(cat):
            self._lose_group(host, cat)
            return
        self._close_training(self.now)
        self._open(host, cat)

    def _convicted(self, host: int, cat: Category) -> bool:
        """The re-run's verdict on `host`: persistent (the category's `found` chance), or the strike that reaches the
        sdc rule's convict_after."""
        if self.rng.random() < cat.found:
            return True
        self.strikes[host] += 1
        params = rule_params(self.rules, "sdc")
        return self.strikes[host] >= int(getattr(params, "convict_after", 1))

    def _pause(self, seconds: float, cause: str) -> None:
        """Every GPU waits `seconds` (a collective timing out on a lost group, a step re-run), nothing else changes;
        the job trains again after, unless something stopped it meanwhile."""
        self._close_training(self.now)
        self._down_as("detection", cause)
        self._stall += 1
        self._push(self.now + seconds, "resume", self._stall)

    def _on_resume(self, token: int) -> None:
        if token != self._stall or self.segment is not None or self.down is None or self.down[0] != "detection":
            return  # the job was stopped meanwhile, for another reason: its restart brings it back
        self._close_down(self.now)
        self._start_training()

    def _open(self, host: int, cat: Category) -> None:
        self._stall += 1  # NOTE: the whole job stops for this one: a group's stall in flight does not end it
        kind = self._kind(cat)
        bad_batch = not fault(kind).names_host
        inc = SimIncident(id=next(self._ids), kind=kind, cause=cat.name, fault_at=self.now, attempt=self.attempt,
                          host=None if bad_batch else host, first_bad_step=self._step(self.progress) if bad_batch else None,
                          suspect_ranks=self._ranks_of(host) if fault(kind).replaces_named else ())
        self.incidents[kind] += 1
        if kind not in self.detect or rule_for(self.rules, kind) is None:
            # Nothing of the healer's watches for it: it stays down until someone notices.
            self._escalate(inc, f"{kind}: no rule of the rule set detects it")
            return
        self._down_as("detection", cat.name)
        self._push(self.now + self.detect[kind], "detected", inc)

    def _on_detected(self, inc: SimIncident) -> None:
        if inc.host is not None and fault(inc.kind).lemon:
            self.named.setdefault(inc.host, []).append(self.now)  # the host's lemon history (a lemon kind names it)
        inc.state, inc.state_since = S.OPEN, self.now
        self._decide(inc)

    def _on_decide(self, inc: SimIncident) -> None:
        self._decide(inc)

    def _decide(self, inc: SimIncident) -> None:
        d = decide_incident(inc, self.rules, self._snapshot(), self.fleet.names, self.now)
        inc.decisions.append(d.action.value)
        if d.action is Action.DIAGNOSE:
            self._diagnose(inc, d)
        elif d.action is Action.REMEDIATE and d.plan is not None:
            self._remediate(inc, d)
        elif d.action is Action.ESCALATE:
            inc.state = S.ESCALATED
            if self.segment is not None:
                self._close_training(self.now)  # a group's incident paged: the job stops for the person
            self._escalate(inc, str(d.basis.get("reason")))
        elif d.action is Action.WAIT and d.next_action_at is not None:
            self._push(self.now + (d.next_action_at - at(self.now)).total_seconds(), "decide", inc)
        else:
            if self.segment is not None:
                self._close_training(self.now)
            self._escalate(inc, f"the policy left the stopped job waiting ({d.basis.get('reason')})")

    def _diagnose(self, inc: SimIncident, d: Decision) -> None:
        live = d.basis.get("runbook") == LIVE_RUNBOOK and bool(d.basis.get("live"))
        stages = self.cfg.stages
        seconds = stages.node_health_live.total_seconds() if live else stages.node_health.total_seconds()
        if not live:
            seconds += stages.stop.total_seconds()  # the attempt is stopped first: node-health wants the host idle
            inc.stopped = True
        if not (inc.degraded and live):
            # NOTE: a group's incident diagnosed with the job stopped (the rule's runbook wants it idle) stops it too
            if self.segment is not None:
                self._close_training(self.now)
            self._down_as("diagnosis", inc.cause)
        assert inc.host is not None  # a diagnosis runs on a suspect host
        cat = self.broken.get(inc.host)
        found = cat is not None and self.rng.random() < (cat.live_found if live else cat.found)
        inc.verdict = Verdict(Status.FAIL, (self.fleet.names[inc.host],)) if found else Verdict(Status.PASS)
        inc.state, inc.state_since = S.DIAGNOSING, self.now
        self._push(self.now + seconds, "decide", inc)

    def _remediate(self, inc: SimIncident, d: Decision) -> None:
        plan = d.plan
        assert plan is not None
        inc.state = S.REMEDIATING
        self.remedies[plan.remedy.value] += 1
        if inc.degraded and plan.replica and plan.remedy is not Remedy.NOTIFY:
            self._regroup(inc, plan)
            return
        if inc.degraded and self.segment is not None:
            self._close_training(self.now)  # not a group's alone after all: the whole job stops
        if plan.remedy is Remedy.NOTIFY:
            # A fault that stopped the job, answered by telling someone: nobody restarts it but a person.
            self._escalate(inc, f"{inc.kind}: notify only, and the job is stopped")
            return
        self._take_hosts(inc, plan)
        self.hosts = [self._index[n] for n in plan.nodes]
        self.dp = plan.dp or self.dp
        self.restart_times.append(self.now)
        if inc.kind in UNNAMED_KINDS:
            self.unnamed_restart_times.append(self.now)
        if plan.remedy is Remedy.ROLLBACK and plan.resume_step is not None:
            resume = self._progress_of_step(plan.resume_step, warm=plan.warm)
        else:
            resume = self.memory if plan.warm else self._durable_at(self._stopped_at(inc))
        self._lose(resume, inc.cause)
        self._restart(warm=plan.warm, stopped=inc.stopped, cause=inc.cause)

    def _take_hosts(self, inc: SimIncident, plan: Any) -> list[int]:
        """A plan's hosts: the excluded ones to repair, spares in (returned), released ones spares again."""
        self.lemons_left_out += len(plan.basis.get("lemons") or {})
        for name in plan.exclude:
            host = self._index[name]
            self._to_repair(host, self.broken.get(host) or self._category(inc.cause))
        current = set(self.hosts)
        joined = [self._index[n] for n in plan.nodes if self._index[n] not in current]
        for host in joined:
            self.fleet.where[host] = Where.JOB
        self.spares_taken += len(joined)
        for name in plan.released:
            self.fleet.where[self._index[name]] = Where.SPARE  # half a replica: idle, a spare for the next loss
        return joined

    def _restart(self, *, warm: bool, stopped: bool, cause: str) -> None:
        self.lossy_restarts.append(self.progress)
        if not warm:
            self.disk_restarts.append(self.progress)
        self.attempt += 1
        self.out.clear()  # every group starts again with the job
        self._stall += 1
        self.restarts["warm" if warm else "cold"] += 1
        self._down_as("restart", cause)
        self.memory = self.progress  # what the restarted ranks hold: the state they resumed from
        self.last_restart_warm_untrained = warm
        took = self.cfg.stages.warm_restart.total_seconds() if warm else self._cold_time(stopped)
        self._push(self.now + took, "trained", None)

    def _on_trained(self, _: None) -> None:
        """The attempt reached its first step, unless a host of it broke meanwhile (then it fails on that host)."""
        if self.segment is not None:
            return  # a later restart's attempt trains already (restart: replica: two incidents may overlap)
        for host in [h for h in self.pending if self.fleet.where[h] == Where.SPARE]:
            self._to_repair(host, self.pending.pop(host))  # it broke while out of the job
        bad = [h for h in self.hosts if h in self.pending]
        if bad:
            cat = self.broken[bad[0]] = self.pending.pop(bad[0])
            self._open(bad[0], cat)
            return
        self._close_down(self.now)
        self._start_training()

    def _escalate(self, inc: SimIncident, reason: str) -> None:
        self._down_as("person", inc.cause)
        self._page(inc, reason)
        self._push(self.now + self.cfg.stages.person.total_seconds(), "person", inc)

    def _page(self, inc: SimIncident, reason: str) -> None:
        rule = rule_for(self.rules, inc.kind)
        # NOTE: a page as Alertmanager would route it (the rule's page policy); with none, the stopped job is found by
        # whoever looks: still a person's time.
        paged = rule is None or page_now(rule.page, S.ESCALATED)
        self.pages.append({"at_day": round(self.now / 86400.0, 3), "incident": inc.id, "kind": inc.kind,
                           "cause": inc.cause, "paged": paged, "reason": reason[:300]})

    def _on_person(self, inc: SimIncident) -> None:
        """Someone answered the page: broken hosts out, spares in, whole replicas dropped if short, a cold restart."""
        if self.segment is not None and not inc.degraded:
            return  # NOTE: the answer to another page (two were open) restarted the job, its broken hosts all out
        if self.segment is not None:
            self._close_training(self.now)  # NOTE: restart: replica trains on meanwhile; the person stops it
        for host in [h for h in self.hosts if h in self.broken or h in self.pending]:
            self._to_repair(host, self.broken.get(host) or self.pending[host])
        kept = [h for h in self.hosts if self.fleet.where[h] == Where.JOB]
        spares = self.fleet.hosts(Where.SPARE)
        need = self.size - len(kept)
        joined = spares[:need]
        for h in joined:
            self.fleet.where[h] = Where.JOB
        self.spares_taken += len(joined)
        hosts = kept + joined
        usable = len(hosts) // self.hpr * self.hpr
        for h in hosts[usable:]:
            self.fleet.where[h] = Where.SPARE
        if usable == 0:
            self._push(self.now + self.cfg.stages.person.total_seconds(), "person", inc)
            return
        self.hosts, self.dp = hosts[:usable], usable // self.hpr
        self._lose(self._durable_at(self._stopped_at(inc)), inc.cause)
        self._restart(warm=False, stopped=True, cause=inc.cause)

    # ---- planned interruptions -------------------------------------------------------------------------------

    def _next_planned(self, now: float) -> float:
        f = self.cfg.failures
        per_s = f.planned / (f.reference_days * 86400.0) * (self.size / f.reference_nodes)
        return now + float(self.rng.exponential(1.0 / per_s))

    def _on_planned(self, _: None) -> None:
        self._push(self._next_planned(self.now), "planned", None)
        if self.segment is None:
            return  # the job is down already: the maintenance waits for it
        self._close_training(self.now)
        # NOTE: taken at a snapshot boundary (the job trains on until it): nothing is lost. A cold job stops cleanly
        # (every rank saves and leaves), waits out the maintenance and starts cold; a warm one swaps the hosts to
        # maintain for spares, or applies its new config, in one warm restart (replica groups: one group at a time).
        self.memory = self.progress
        self._down_as("planned", "planned")
        self._stall += 1
        self.restarts["planned"] += 1
        if self.cfg.restart == "cold":
            self.durable.append((self.progress, self.now))
            self.out.clear()
            self.attempt += 1
            gap = self.cfg.stages.planned_downtime.total_seconds() + self._cold_time(stopped=False)
        else:
            if self.cfg.restart == "warm":
                self.attempt += 1
            gap = self.cfg.stages.planned_restart.total_seconds()
        self._push(self.now + gap, "trained", None)

    # ---- the analytic baseline ---------------------------------------------------------------------------------

    def _analytic_restart_s(self) -> float:
        """policy: false: the one restart every failure costs (detection by the categories' counts, stop, start)."""
        cats = self.cfg.failures.categories
        total = sum(c.count for c in cats)
        detect = sum(c.count * self.detect.get(c.sees, 0.0) for c in cats) / total
        return detect + self._cold_time(stopped=False)

    def _analytic_failure(self, f: Failure) -> None:
        """policy: false: back to the newest durable save, a fixed restart, a fresh host (failures during the restart
        start it again)."""
        if self.segment is not None:
            self._close_training(self.now)
            self._lose(self._durable_at(self.now), f.category.name)
            self._down_as("restart", f.category.name)
        self._analytic_token += 1
        self._push(self.now + self.u0, "analytic_up", self._analytic_token)

    def _on_analytic_up(self, token: int) -> None:
        if token == self._analytic_token:
            self._close_down(self.now)
            self._start_training()

    # ---- what the launcher would say ---------------------------------------------------------------------------

    def _cold_time(self, stopped: bool = True) -> float:
        st, ck = self.cfg.stages, self.cfg.checkpoint
        return (0.0 if stopped else st.stop.total_seconds()) + st.cold_start.total_seconds() + ck.load.total_seconds()

    def _category(self, name: str) -> Category:
        return next(c for c in self.cfg.failures.categories if c.name == name)

    def _progress_of_step(self, step: int, warm: bool) -> float:
        saves = [p for p, _ in self.durable] + ([self.memory] if warm else [])
        return max((p for p in saves if self._step(p) == step), default=self._durable_at(self.now))

    def _snapshot(self) -> JobSnapshot:
        names = self.fleet.names
        window = self.rules.limits.lemon_window.total_seconds()
        counts = {names[h]: n for h, times in self.named.items()
                  if (n := sum(1 for t in times if self.now - t < window))}
        saves = {self._step(p) for p, ready in self.durable if ready <= self.now}
        if self.cfg.restart == "warm":
            saves.add(self._step(self.memory))
        warm_off = ("the job does not run warm" if self.cfg.restart != "warm" else
                    "its last restart was warm and never trained" if self.last_restart_warm_untrained else None)
        return JobSnapshot(nodes=tuple(names[h] for h in self.hosts),
                           spares=tuple(names[h] for h in self.fleet.hosts(Where.SPARE)), dp=self.dp,
                           checkpoint_steps=tuple(sorted(saves)), restarts=tuple(self.restart_times),
                           unnamed_restarts=tuple(self.unnamed_restart_times),
                           node_incidents=counts, attempt=self.attempt, warm_unavailable=warm_off,
                           replica_groups=self.dp if self.cfg.restart == "replica" else 0,
                           replica_hosts=self._keepers() if self.cfg.restart == "warm" else {})

    def _ranks_of(self, host: int) -> tuple[int, ...]:
        """The global ranks of a host of the job (a host's GPUs in order, hosts in the job's order)."""
        if host not in self.hosts:
            return ()
        first = self.hosts.index(host) * self.gpn
        return tuple(range(first, first + self.gpn))

    def _keepers(self) -> dict[str, str]:
        """Each host's keeper of its ranks' snapshot replicas: the next host of the job (train/warm/replicas.py)."""
        names = [self.fleet.names[h] for h in self.hosts]
        return dict(zip(names, names[1:] + names[:1])) if len(names) > 1 else {}

    def _summary(self) -> dict[str, Any]:
        cfg = self.cfg
        return {"days": cfg.days, "seed": cfg.seed, "restart": cfg.restart, "policy": cfg.policy,
                "nodes": cfg.job.nodes, "gpus": cfg.job.gpus, "spares": cfg.job.spares,
                "checkpoint_interval_s": cfg.checkpoint.interval.total_seconds(),
                "failure_scale": cfg.failures.scale,
                "failures_per_day": round(cfg.failures.rate_per_node * cfg.job.nodes * 86400.0, 3),
                "detection_s": {k: round(v, 3) for k, v in sorted(self.detect.items())},
                "analytic_restart_s": round(self.u0, 3)}

