"""The self-healing loop of one job: heartbeats and the supervisor's view -> detectors -> remediation policy
-> supervisor actions, with every incident written to `<run_dir>/incidents.jsonl` (the ledger the goodput
report reads, and the source of truth), then handed to `on_event` (the healer's database and Alertmanager,
see incident_mirror.py).

Each tick: take the sidecars' heartbeat batches, poll the processes, run the detectors. A finding that is
new opens an incident. After a crash or a hang the attempt is stopped at once (nobody can checkpoint, so the
grace is short) and the suspect nodes run their diagnostics (`node-health`, on each node, see
node_diagnosis.py); the policy (healer.core.remediation.plan, pure) chooses the action from the incident and that
verdict, with its basis; the loop carries it out: start the next attempt on the planned nodes (a node that
failed its diagnostics replaced by a spare) from the newest good checkpoint, and note when the new
attempt's first step arrives (recovered). A spent budget escalates: the job is stopped and the loop ends,
so a job that keeps failing never turns into a restart loop.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from healer.core.detectors.base import Detector, Finding
from healer.core.detectors.crash import Crash
from healer.core.detectors.hang import Hang
from healer.core.detectors.loss_spike import LossSpike, robust_z
from healer.core.heartbeats import HeartbeatTable
from healer.jsonl import append_jsonl, read_jsonl
from healer.core.remediation import (
    Budgets,
    IncidentInput,
    JobFacts,
    Plan,
    Remedy,
    VerdictInput,
    plan,
)
from healer.core.remediation_history import NodeEvent, NodeHistory
from healer.launchers.node_diagnosis import NodeVerdict, diagnose_nodes, to_verdict
from healer.launchers.sidecars import NodeSidecars
from healer.launchers.supervisor import Supervisor, last_start
from train.checkpoint.catalog import (
    CheckpointInfo,
    choose_resume,
    list_checkpoints,
    verify,
)

log = logging.getLogger(__name__)
DIAGNOSED_KINDS = ("crash", "hang")
"""Incidents whose suspect nodes run their diagnostics before the decision (the others name no node to test,
or, like a GPU fault, already carry the node's own evidence)."""


@dataclass(slots=True)
class IncidentRecord:
    id: int
    kind: str
    key: str
    summary: str
    suspect_nodes: list[str]
    suspect_ranks: list[int]
    detected_at: float
    attempt: int
    """The attempt the fault happened in."""
    evidence: dict[str, Any]
    state: str = "open"
    """open -> remediating -> resolved, or escalated."""
    diagnosed_at: float | None = None
    """When the suspect nodes' diagnostics finished."""
    verdict: str | None = None
    """The diagnostics' worst status (pass, degraded, fail, error); None: not diagnosed."""
    diagnosis: list[dict[str, Any]] = field(default_factory=list)
    """Per node: status, summary, seconds."""
    action: str | None = None
    plan: dict[str, Any] | None = None
    remediated_at: float | None = None
    """When the next attempt was started."""
    resume_step: int | None = None
    """The checkpoint step the next attempt resumed from."""
    recovered_at: float | None = None
    """When the next attempt's first step arrived."""
    taken_over_at: float | None = None
    """When a restarted healer took the incident over from one that died in the middle of it."""
    first_step_after: int | None = None
    lost_steps: int | None = None
    """Steps done before the fault and done again after it (resume step .. highest step seen)."""
    highest_step: int | None = None


class SelfHealLoop:
    @dataclass(kw_only=True, slots=True)
    class Config:
        nodes: tuple[str, ...]
        """The nodes the job starts on."""
        spares: tuple[str, ...] = ()
        """Idle nodes that can replace an excluded one."""
        dp: int = 1
        """The job's data-parallel degree on `nodes`."""
        budgets: Budgets = field(default_factory=Budgets)
        """Restart budget, backoff, lemon threshold."""
        crash: Crash.Config = field(default_factory=Crash.Config)
        """The crash detector's settings."""
        hang: Hang.Config = field(default_factory=Hang.Config)
        """The hang detector's settings."""
        tick: timedelta = timedelta(seconds=0.25)
        """How often the loop looks."""
        fault_grace: timedelta = timedelta(seconds=0.5)
        """SIGTERM to SIGKILL when stopping a crashed or hung attempt: its ranks are stuck in a collective
        that will never complete, so no final checkpoint is possible and waiting longer only adds to MTTR."""
        runbook: str | None = "node-health"
        """Run on each suspect node after a crash or a hang, before deciding; None: decide without."""
        diagnosis_timeout: timedelta = timedelta(seconds=90)
        """A node's runbook past this is an `error` verdict (no node is blamed on a guess)."""

        def __post_init__(self) -> None:
            if not self.nodes or set(self.nodes) & set(self.spares):
                raise ValueError("nodes must be non-empty and not overlap spares")
            if self.dp < 1:
                raise ValueError(f"dp must be >= 1, got {self.dp}")
            if self.tick <= timedelta(0) or self.fault_grace < timedelta(0):
                raise ValueError("tick must be > 0 and fault_grace >= 0")
            if self.diagnosis_timeout <= timedelta(0):
                raise ValueError(f"diagnosis_timeout must be > 0, got {self.diagnosis_timeout}")

    def __init__(self, cfg: Config, supervisor: Supervisor, sidecars: NodeSidecars, table: HeartbeatTable,
                 token: str, history: NodeHistory | None = None,
                 extra_detectors: list[Detector] | None = None, clock: Callable[[], float] = time.time,
                 on_event: Callable[[dict[str, Any], str, float], None] | None = None) -> None:
        """`on_event(incident, event, at)`: told each journal event after it is written (it must not raise)."""
        self.cfg, self.sup, self.sidecars, self.table = cfg, supervisor, sidecars, table
        self._token, self.history, self.clock, self.on_event = token, history, clock, on_event
        self.detectors: list[Detector] = [Crash(cfg.crash), Hang(cfg.hang), *(extra_detectors or [])]
        self.nodes, self.spares, self.dp = tuple(cfg.nodes), list(cfg.spares), cfg.dp
        self.incidents: list[IncidentRecord] = []
        self.restarts: list[datetime] = []
        self.outcome: str | None = None
        self.ledger = supervisor.cfg.run_dir / "incidents.jsonl"
        self._handled: set[str] = set()
        self.skip_steps: set[int] = set()
        """Steps whose batches every later attempt passes over (rollbacks)."""
        self.highest: dict[int, int] = {}
        """Per attempt, the highest step its ranks reported (the work a fault puts at risk)."""

    # ---- the loop ------------------------------------------------------------------------------------

    def start(self) -> None:
        self.sidecars.start()
        self.sup.start(self._token, self.nodes, dp=self.dp)

    def take_over(self) -> None:
        """Go on with a run whose previous healer died (`megaheal run --resume`), instead of `start`.

        From the run's journals it restores what the dead healer knew: the incidents, the restarts spent
        (the budget goes on counting), the node set and dp degree (an excluded node stays out), the skipped
        batches. It stops whatever the last attempt left running (the supervisor's take_over), then finishes
        what was in flight: an incident not yet acted on is diagnosed (unless it was) and remediated now; one
        already remediating waits for the new attempt's first step as before.
        """
        # NOTE: a line cut short by the healer that died while writing it is skipped by read_jsonl.
        entries = [e for e in read_jsonl(self.ledger) if isinstance(e.get("incident"), dict) and "id" in e["incident"]]
        latest: dict[int, dict[str, Any]] = {}
        for e in entries:
            latest[e["incident"]["id"]] = e["incident"]
            if e["event"] == "restarted":
                self.restarts.append(_utc(e["at"]))
        known = {f.name for f in fields(IncidentRecord)}
        self.incidents = [IncidentRecord(**{k: v for k, v in latest[i].items() if k in known}) for i in sorted(latest)]
        for inc in self.incidents:
            if inc.action == Remedy.ROLLBACK.value and inc.plan:
                self.skip_steps |= set(inc.plan.get("skip_steps") or [])
        excluded = {n for inc in self.incidents for n in (inc.plan or {}).get("exclude", [])
                    if inc.action == Remedy.EXCLUDE_AND_RESTART.value}
        last = last_start(self.sup.cfg.run_dir)
        if last is not None:
            self.nodes = tuple(last["nodes"])
            self.dp = int(last["dp"] or self.dp)
        self.spares = [n for n in self.cfg.spares if n not in self.nodes and n not in excluded]
        in_flight = [i for i in self.incidents if i.state in ("open", "remediating")]
        now = self.clock()
        for inc in in_flight:
            inc.taken_over_at = now
            self._write(inc, "taken-over")
        killed = self.sup.take_over(self._token)
        log.warning("taking over %s: %d incident(s) in flight, %d process(es) of the last attempt stopped",
                    self.sup.cfg.job, len(in_flight), len(killed))
        self.sidecars.start()
        undecided = [i for i in in_flight if i.state == "open"]
        for older in undecided[:-1]:
            older.state = "resolved"  # one restart answers them all: the newest one drives it
            self._write(older, "superseded")
        if undecided:
            inc = undecided[-1]
            verdict = (to_verdict([NodeVerdict(**d) for d in inc.diagnosis]) if inc.verdict is not None
                       else self._diagnose(inc))
            self._remediate(inc, verdict)
            return
        resume = "auto"
        rollback = next((i for i in in_flight if i.action == Remedy.ROLLBACK.value and i.resume_step is not None),
                        None)
        if rollback is not None:
            # NOTE: checkpoints newer than the rollback point may hold the poisoned weights: not "auto".
            point = next((c.path for c in self._good_checkpoints() if c.step == rollback.resume_step), None)
            if point is None:
                log.warning("the rollback point (step %s) of incident %d is gone: resuming from the newest good "
                            "checkpoint", rollback.resume_step, rollback.id)
            resume = str(point) if point is not None else "auto"
        # NOTE: this restart is the healer's own doing, not the job's: it spends no restart budget.
        self.sup.start(self._token, self.nodes, dp=self.dp, resume=resume, extra=self._skip_override())
        for inc in in_flight:  # remediating: their restart is this attempt now (the last one was stopped)
            inc.remediated_at = self.clock()
            self._write(inc, "restarted")

    def run(self, timeout: timedelta, on_tick: Callable[[SelfHealLoop], None] | None = None) -> str:
        """Tick until the job finishes, escalates, or `timeout` passes; returns the outcome."""
        deadline = self.clock() + timeout.total_seconds()
        try:
            while self.outcome is None:
                if self.clock() > deadline:
                    self.sup.stop(self._token, self.cfg.fault_grace)
                    self.outcome = "timeout"
                    break
                self.tick()
                if on_tick is not None:
                    on_tick(self)
                time.sleep(self.cfg.tick.total_seconds())
        finally:
            self.sidecars.stop()
        return self.outcome

    def tick(self) -> None:
        for batch in self.sidecars.batches():
            self.table.ingest(batch)
        self.sup.poll()
        now = self.clock()
        self._note_recovery(now)
        attempt = self.sup.attempt
        if attempt is not None and attempt.succeeded:
            self.outcome = "finished"
            return
        # NOTE: until the new attempt reports a step, the table still holds the old attempt's last heartbeats
        # (a NaN, a slow phase table): only the process-based detectors may speak for the new attempt then.
        reporting = attempt is not None and any(b.entry.pid in attempt.ranks and b.step is not None
                                                for b in self.table.ranks())
        for detector in self.detectors:
            if not reporting and not isinstance(detector, (Crash, Hang)):
                continue
            for finding in detector.evaluate(self.table, now).firing:
                # NOTE: per attempt: the same fault in a later attempt (a second hang) is a new incident.
                key = f"{detector.name}:{finding.key}:{attempt.number if attempt else 0}"
                if key not in self._handled:
                    self._handled.add(key)
                    self._handle(detector.name, finding, now)
                    return  # one remediation per tick: the next tick sees the new attempt

    # ---- incidents -----------------------------------------------------------------------------------

    def _handle(self, kind: str, f: Finding, now: float) -> None:
        ev = f.evidence
        nodes = sorted({n for n in [ev.get("suspect_node"), *ev.get("suspect_nodes", []), f.node] if n})
        ranks = ev.get("suspect_ranks") or ([ev["suspect_rank"]] if ev.get("suspect_rank") is not None else [])
        inc = IncidentRecord(id=len(self.incidents) + 1, kind=kind, key=f.key, summary=f.summary,
                             suspect_nodes=nodes, suspect_ranks=list(ranks), detected_at=now,
                             attempt=self.sup.attempt.number if self.sup.attempt else 0, evidence=ev)
        self.incidents.append(inc)
        log.warning("incident %d (%s): %s", inc.id, kind, f.summary)
        self._write(inc, "detected")
        # NOTE: only faults that point at the node itself count towards lemon history; a straggler or a slow
        # collective without a failed diagnosis may be the job's own doing.
        if self.history is not None and nodes and kind in ("crash", "hang", "gpu_fault"):
            self.history.record([NodeEvent(n, self.sup.cfg.job, kind, inc.id, _utc(now)) for n in nodes])
        self._remediate(inc, self._diagnose(inc))

    def _diagnose(self, inc: IncidentRecord) -> VerdictInput | None:
        """After a crash or a hang: stop what is left of the attempt and run the runbook on the suspect nodes."""
        nodes = [n for n in inc.suspect_nodes if n in self.nodes]
        if self.cfg.runbook is None or inc.kind not in DIAGNOSED_KINDS or not nodes:
            return None
        # NOTE: node-health wants the node idle (a process still holding a device fails it), and a crashed or
        # hung job cannot go on anyway.
        self.sup.stop(self._token, self.cfg.fault_grace)
        verdicts = diagnose_nodes(self.sup.launcher, self.sup.cfg.run_dir, nodes, self.cfg.runbook,
                                  self.cfg.diagnosis_timeout)
        verdict = to_verdict(verdicts)
        inc.diagnosed_at, inc.verdict = self.clock(), verdict.status
        inc.diagnosis = [v.to_payload() for v in verdicts]
        for v in verdicts:
            if v.status != "pass":
                log.warning("incident %d: %s on %s: %s: %s", inc.id, self.cfg.runbook, v.node, v.status, v.summary)
        self._write(inc, "diagnosed")
        return verdict

    def _remediate(self, inc: IncidentRecord, verdict: VerdictInput | None) -> None:
        if inc.kind in ("nonfinite", "loss_spike") and self.sup.attempt is not None:
            # The heartbeats sample steps; rank 0's JSON lines have every step: take the true first bad one
            # (the rollback skips the batches just before it, so one step late would skip the wrong ones).
            spike = next((d.config for d in self.detectors if isinstance(d, LossSpike)), LossSpike.Config())
            first = (first_nonfinite_step(self.sup.cfg.run_dir, self.sup.attempt.started_at)
                     if inc.kind == "nonfinite" else
                     first_spike_step(self.sup.cfg.run_dir, self.sup.attempt.started_at, spike))
            if first is not None and first < inc.evidence.get("first_step", first + 1):
                inc.evidence = {**inc.evidence, "first_step": first, "first_step_from": "ranks/0.jsonl"}
        while True:
            now = self.clock()
            p = plan(IncidentInput(id=inc.id, kind=inc.kind, suspect_nodes=tuple(inc.suspect_nodes),
                                   first_bad_step=inc.evidence.get("first_step")),
                     verdict, self._facts(now), self.cfg.budgets)
            if p.remedy is not Remedy.WAIT:
                break
            assert p.not_before is not None
            time.sleep(max(0.0, (p.not_before - _utc(now)).total_seconds()))
        inc.action, inc.plan = p.remedy.value, p.to_payload()
        self._write(inc, "decided")
        if p.remedy is Remedy.NOTIFY:
            inc.state = "resolved"  # told (logged, in the ledger); nothing to wait for
            self._write(inc, "notified")
            return
        self.sup.stop(self._token, self.cfg.fault_grace)
        if p.remedy is Remedy.ESCALATE:
            inc.state, self.outcome = "escalated", "escalated"
            self._write(inc, "escalated")
            return
        self._restart(inc, p)

    def _restart(self, inc: IncidentRecord, p: Plan) -> None:
        self.spares = [s for s in self.spares if s not in p.nodes]
        self.nodes, self.dp = p.nodes, p.dp or self.dp
        resume = "auto"
        if p.resume_step is not None:
            chosen = next(c for c in self._good_checkpoints() if c.step == p.resume_step)
            inc.resume_step, resume = chosen.step, str(chosen.path)
        else:
            # What --resume auto will pick: the same choice the ranks make.
            choice = choose_resume(self.sup.cfg.run_dir / "checkpoints")
            inc.resume_step = choice.checkpoint.step if choice.checkpoint is not None else 0
        # Skips accumulate: a later restart from an older checkpoint must pass over the same batches again.
        self.skip_steps |= set(p.skip_steps)
        self.restarts.append(_utc(self.clock()))
        self.sup.start(self._token, self.nodes, dp=self.dp, resume=resume, extra=self._skip_override())
        inc.state, inc.remediated_at = "remediating", self.clock()
        self._write(inc, "restarted")

    def _skip_override(self) -> tuple[str, ...]:
        return (f"skip_steps=[{','.join(map(str, sorted(self.skip_steps)))}]",) if self.skip_steps else ()

    def _note_recovery(self, now: float) -> None:
        a = self.sup.attempt
        if a is None:
            return
        steps = [b.step for b in self.table.ranks() if b.entry.pid in a.ranks and b.step is not None]
        if steps:
            self.highest[a.number] = max(self.highest.get(a.number, -1), max(steps))
        pending = [i for i in self.incidents if i.state == "remediating"]
        if steps and pending:
            for inc in pending:
                inc.state, inc.recovered_at, inc.first_step_after = "resolved", now, min(steps)
                inc.highest_step = self.highest.get(inc.attempt)
                if inc.highest_step is not None and inc.resume_step is not None:
                    # Steps are numbered from 0: steps resume_step..highest_step are done again.
                    inc.lost_steps = max(0, inc.highest_step + 1 - inc.resume_step)
                self._write(inc, "recovered")

    def _facts(self, now: float) -> JobFacts:
        counts = self.history.counts(_utc(now) - self.cfg.budgets.lemon_window) if self.history else {}
        steps = tuple(c.step for c in self._good_checkpoints())
        return JobFacts(now=_utc(now), nodes=self.nodes, spares=tuple(self.spares), restarts=tuple(self.restarts),
                        node_incidents=counts, checkpoint_steps=steps, dp=self.dp)

    def _good_checkpoints(self) -> list[CheckpointInfo]:
        return [c for c in list_checkpoints(self.sup.cfg.run_dir / "checkpoints") if not verify(c)]

    def _write(self, inc: IncidentRecord, event: str) -> None:
        at = self.clock()
        append_jsonl(self.ledger, {"event": event, "at": at, "incident": asdict(inc)})
        if self.on_event is not None:
            self.on_event(asdict(inc), event, at)  # the healer's database and Alertmanager (IncidentMirror)


def _rank0_steps(run_dir: Path, since: float) -> list[dict[str, Any]]:
    # Python's json reads NaN and Infinity, as the trainer writes them.
    return [r for r in read_jsonl(run_dir / "ranks" / "0.jsonl")
            if r.get("time", 0) >= since and isinstance(r.get("step"), int) and isinstance(r.get("loss"), float)]


def first_nonfinite_step(run_dir: Path, since: float) -> int | None:
    """The first step after `since` whose loss or grad norm rank 0 recorded as NaN or infinite."""
    for rec in _rank0_steps(run_dir, since):
        if not all(math.isfinite(rec.get(k, 0.0)) for k in ("loss", "grad_norm")):
            return int(rec["step"])
    return None


def first_spike_step(run_dir: Path, since: float, config: LossSpike.Config) -> int | None:
    """The first step after `since` whose loss is a spike by the loss_spike detector's own test, over every
    step rank 0 recorded (the detector itself sees only the steps the heartbeats sampled)."""
    window: list[float] = []
    for rec in _rank0_steps(run_dir, since):
        loss = rec["loss"]
        if len(window) >= config.min_samples and robust_z(loss, window, config.min_mad)[0] > config.threshold:
            return int(rec["step"])
        window = (window + [loss])[-config.window:]
    return None


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)
