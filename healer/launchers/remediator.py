"""A job's hands, whatever its launcher: the Remediator port (healer/ports.py) over the coordinator of its node agents
(healer/launchers/coordinator.py), with the job's placement (healer/launchers/placement.py).

Orders (stop, diagnose, restart) run one after the other on a worker thread of their own, so the healer's loop
never waits for a 90 s diagnosis or an attempt that takes its time to die; each reports back through its callback.
What the detectors must stop seeing changes at once, on the caller's thread: an attempt the healer is about to
stop is marked stopping in the process view before the order is queued.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from ground.names import check_name
from healer.decide.catalogue import BadStep, fault
from healer.decide.save_interval import IntervalBounds
from healer.launchers import rank_records
from healer.launchers.coordinator import Coordinator
from healer.launchers.coordinator_base import program_resume
from healer.launchers.coordinator_groups import NothingToJoin
from healer.launchers.drain import Drainer
from healer.launchers.node_diagnosis import diagnose_nodes
from healer.launchers.placement import Placement
from healer.launchers.preflight import PREFLIGHT_RUNBOOK, failed, screened_placement
from healer.launchers.remediator_groups import GroupRestarts
from healer.launchers.save_tuning import Intervals, SaveTuning
from healer.launchers.warm_control import WarmUnavailable
from healer.ports import Failed, HostVerdict, JobState, RestartOrder, Started, TakenOver
from train.checkpoint.catalog import choose_resume, list_checkpoints, verify
from wire.journal import Grown, Journal, Returned, Screened
from wire.run_paths import RunPaths
from wire.verdict import Status
from wire.warm_plan import keeper_hosts

log = logging.getLogger(__name__)


class Across(Protocol):
    """Runs a runbook once across hosts (healer/launchers/job_diagnosis.py)."""

    def __call__(self, nodes: list[str], runbook: str) -> list[HostVerdict]:
        """A verdict per host of `nodes`."""

    def stop(self) -> None:
        """End the run in flight, if any."""


WARM_READY_WAIT_S = 60.0
WITNESS_WAIT_S = 20.0
"""The longest a restart waits for the witnesses of a silent host's loss (each is bounded to a few seconds)."""
"""How long a warm restart waits for every rank to say where it resumed from (a restart that fails meanwhile ends
the wait: a rank of it failed, or its attempt is done, and the crash that follows restarts cold)."""


class SavedCheckpoints(Protocol):
    """Where the checkpoints a user's program said it saved are kept (healer.observe.heartbeats.HeartbeatTable)."""

    def saved_steps(self, job: str) -> tuple[int, ...]: ...

    def forget_saved_after(self, job: str, step: int) -> None: ...


class AgentRemediator(GroupRestarts):
    @dataclass(kw_only=True, slots=True)
    class Config:
        nodes: tuple[str, ...]
        """The hosts the job starts on."""
        spares: tuple[str, ...] = ()
        """Idle hosts that can replace one left out."""
        dp: int = 1
        """The job's data-parallel degree on `nodes`."""
        valid_dp: tuple[int, ...] = ()
        """Data-parallel degrees the training layout accepts (see train/layout.py); empty: any."""
        total_steps: int | None = None
        """The steps the job trains in all (megaheal's trainer's config); None: not known (a program's)."""
        preflight: bool = False
        """Screen every host and spare before the first attempt (healer/launchers/preflight.py)."""
        preflight_timeout: timedelta = timedelta(seconds=30)
        """A host's preflight runbook past this is an `error` verdict (its steps are bounded at ~15 s together)."""
        rescreen_every: timedelta | None = timedelta(minutes=10)
        """Where the run screens its hosts, how often its idle spares, and the hosts it left out that a screening can
        take back, are screened again (None: never)."""
        grow: bool = True
        """A job that came back smaller grows back onto spares again (a repaired host that passed its screening)."""
        grow_grace: timedelta = timedelta(seconds=60)
        """SIGTERM to SIGKILL when stopping an attempt to grow it back: megaheal's trainer saves at the step it is in
        and exits, so that no step is lost."""
        fault_grace: timedelta = timedelta(seconds=0.5)
        """SIGTERM to SIGKILL when stopping an attempt after a fault: its ranks are stuck in a collective that will
        never complete, so no final checkpoint is possible and waiting longer only adds to the time to recover."""
        diagnosis_timeout: timedelta = timedelta(seconds=90)
        """A host's runbook past this is an `error` verdict (no host is blamed on a guess)."""
        evidence_timeout: timedelta = timedelta(seconds=5)
        """Per rank, for its stack dump when a hang is looked at (the dump does not stop the rank: it is quick)."""
        replica_groups: int = 0
        """The job trains as replica groups, one per host, at most this many (train/ft/; `dp` counts the groups);
        0: one world."""
        save_intervals: Intervals | None = None
        """megaheal's trainer's configured save and snapshot intervals, tuned at each restart that loses work
        (healer/launchers/save_tuning.py); None: left as they are (a program's, or tuning off)."""
        save_bounds: IntervalBounds = field(default_factory=IntervalBounds)

        def __post_init__(self) -> None:
            if not self.nodes or set(self.nodes) & set(self.spares):
                raise ValueError("nodes must be non-empty and not overlap spares")
            for node in (*self.nodes, *self.spares):
                check_name(node, "node")
            if self.dp < 1:
                raise ValueError(f"dp must be >= 1, got {self.dp}")
            if self.fault_grace < timedelta(0) or self.diagnosis_timeout <= timedelta(0):
                raise ValueError("fault_grace must be >= 0 and diagnosis_timeout > 0")

    def __init__(self, cfg: Config, supervisor: Coordinator, token: str, drainer: Drainer | None = None,
                 across: Across | None = None, saved: SavedCheckpoints | None = None) -> None:
        """`drainer`: drains the hosts a restart leaves out that their incident proved bad and records their Slurm
        state in the incident (None: neither);
        `across`: runs a runbook of scope job across hosts from here (healer/launchers/job_diagnosis.py; None: such
        runbooks cannot run, every host gets an `error` verdict saying so);
        `saved`: the checkpoints a user's program said it saved (the heartbeat table), what its rollbacks go back
        to (megaheal's trainer: its checkpoint catalogue on the disk)."""
        self.cfg, self.sup, self.token, self.drainer, self.across = cfg, supervisor, token, drainer, across
        self.saved = saved
        self.job = supervisor.cfg.job
        self.placement = Placement(nodes=tuple(cfg.nodes), spares=tuple(cfg.spares), dp=cfg.dp)
        """Where the job runs: replaced whole at each change (state() reads it from another thread)."""
        self.tuning = (SaveTuning(cfg.save_intervals, cfg.save_bounds, started_at=time.time())
                       if cfg.save_intervals is not None else None)
        self._orders: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._screening = threading.Lock()
        """Held while idle spares and left-out hosts are screened again (rescreen)."""
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="megaheal-remediator", daemon=True)
        self._thread.start()

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.placement.nodes

    @property
    def spares(self) -> tuple[str, ...]:
        return self.placement.spares

    @property
    def dp(self) -> int:
        return self.placement.dp

    @property
    def excluded(self) -> frozenset[str]:
        return self.placement.excluded

    @property
    def skip_steps(self) -> frozenset[int]:
        return self.placement.skip_steps

    # ---- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        """The job's first attempt, on the hosts that passed preflight where the run screens them (PreflightError:
        it cannot start on them)."""
        if self.cfg.preflight:
            self.preflight()
        self.sup.start(self.token, self.nodes, dp=self.dp, spares=self.spares)

    def preflight(self) -> dict[str, dict[str, Any]]:
        """Every host and spare runs the preflight runbook on itself, at once; each verdict goes into the journal, and
        those that failed leave the job (replaced by spares that passed, or the job smaller) and are drained where
        the run drains. What was done with each failed host."""
        verdicts = diagnose_nodes(self.sup.run_runbook, [*self.nodes, *self.spares], PREFLIGHT_RUNBOOK,
                                  self.cfg.preflight_timeout)
        # NOTE: drained (where the run drains) even when the job then cannot start: the host failed all the same.
        bad, done = self._screened(verdicts, attempt=self.sup.attempt.number + 1 if self.sup.attempt is not None else 0)
        if bad:
            self.placement = screened_placement(self.placement, bad, self.cfg.valid_dp)
            log.warning("preflight left out %s: the job starts on %s (dp %d), spares %s", ", ".join(sorted(bad)),
                        ", ".join(self.nodes), self.dp, ", ".join(self.spares) or "none")
        return done

    def rescreen(self) -> None:
        """Screen the idle spares again, and the hosts left out that a passing screening takes back, on a thread of
        its own (a crash's restart must not wait behind it): a spare that fails is a spare no more, and is drained
        where the run drains; a host left out that passes is a spare again, given back to the scheduler where
        megaheal drained it. One screening at a time."""
        hosts = [*self.spares, *self.placement.returnable()]
        if not hosts or not self._screening.acquire(blocking=False):
            return

        def screen() -> None:
            try:
                verdicts = diagnose_nodes(self.sup.run_runbook, hosts, PREFLIGHT_RUNBOOK, self.cfg.preflight_timeout)
                # NOTE: applied on the order queue, as every change of the placement is; a spare a restart took
                # meanwhile is in the job now, and its verdict no longer the placement's business.
                self._submit(lambda: self._rescreened(verdicts))
            finally:
                self._screening.release()

        threading.Thread(target=self._guarded, args=(screen,), name="megaheal-rescreen", daemon=True).start()

    def _rescreened(self, verdicts: list[HostVerdict]) -> None:
        self._drop_spares(verdicts)
        out = set(self.placement.returnable())
        attempt = self.sup.attempt.number if self.sup.attempt is not None else 0
        back = []
        for v in (v for v in verdicts if v.node in out):
            # NOTE: a host left out was drained when it was: a failure now is no news, and is not drained again.
            self.sup.journal_event(Screened(at=time.time(), attempt=attempt, node=v.node, status=v.status.value,
                                            summary=v.summary, seconds=round(v.seconds, 2)))
            if v.status is Status.PASS:
                back.append(v.node)
        for node in back:
            done = self.drainer.returned(node) if self.drainer is not None else None
            self.sup.journal_event(Returned(at=time.time(), attempt=attempt, node=node, scheduler=done))
        if back:
            self.placement = self.placement.taking_back(back)
            log.warning("%s passed screening again: spare(s) now %s", ", ".join(back), ", ".join(self.spares))

    def grow_target(self) -> tuple[tuple[str, ...], int] | None:
        """The hosts and dp the job can grow back to with its spares now (healer/launchers/placement.py), or None."""
        if not self.cfg.grow:
            return None
        return self.placement.grown(len(self.cfg.nodes), self.cfg.dp, self.cfg.valid_dp)

    def grow(self, nodes: tuple[str, ...], dp: int) -> None:
        """A planned restart onto more hosts: the attempt is stopped as a preemption is (megaheal's trainer saves at
        the step it is in and exits), and the next starts cold on `nodes` at `dp` from the newest checkpoint,
        resharded: the samples go on from where the stop left them. The journal says so (`Grown`)."""
        self.sup.view.stopping(self.job)
        before, before_dp = self.nodes, self.dp

        def run() -> None:
            self.sup.stop(self.token, self.cfg.grow_grace)
            choice = choose_resume(RunPaths(Path(self.sup.cfg.run_dir)).checkpoints) \
                if self.sup.cfg.program is None else None
            self.placement, _ = self.placement.moved_to(nodes, dp, ())
            attempt = self.sup.start(self.token, self.nodes, dp=self.dp, resume="auto",
                                     extra=self._extra(), spares=self.spares)
            step = choice.checkpoint.step if choice is not None and choice.checkpoint is not None else None
            self.sup.journal_event(Grown(at=time.time(), attempt=attempt.number, nodes=list(nodes), dp=dp,
                                         from_nodes=list(before), from_dp=before_dp, resume_step=step))
            log.warning("grew the job back onto %s (dp %d, was %d on %s) from the checkpoint of step %s",
                        ", ".join(nodes), dp, before_dp, ", ".join(before), step)

        self._submit(run)

    def _drop_spares(self, verdicts: list[HostVerdict]) -> None:
        idle = [v for v in verdicts if v.node in self.spares]
        bad, _ = self._screened(idle, attempt=self.sup.attempt.number if self.sup.attempt is not None else 0)
        if bad:
            self.placement = replace(self.placement, spares=tuple(s for s in self.spares if s not in bad),
                                     excluded=self.excluded | set(bad))
            log.warning("re-screening left out spare(s) %s; spares now %s", ", ".join(sorted(bad)),
                        ", ".join(self.spares) or "none")

    def _screened(self, verdicts: list[HostVerdict], attempt: int) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
        """The hosts that failed screening (host -> why), drained where the run drains, and every verdict in the
        journal; and what was done with each failed host."""
        bad = failed(verdicts)
        done = {n: self.drainer.screened_out(n, why) if self.drainer is not None else
                {"drained": False, "error": "no drainer"} for n, why in sorted(bad.items())}
        for v in verdicts:
            self.sup.journal_event(Screened(at=time.time(), attempt=attempt, node=v.node, status=v.status.value,
                                            summary=v.summary, seconds=round(v.seconds, 2), drain=done.get(v.node)))
            (log.warning if v.status in (Status.FAIL, Status.ERROR) else log.info)(
                "screening %s: %s: %s (%.1f s)", v.node, v.status.value, v.summary, v.seconds)
        return bad, done

    def start_next(self, resume: str = "auto") -> None:
        """The next attempt on the current hosts, outside any incident (a take-over found nothing to finish)."""
        self.sup.start(self.token, self.nodes, dp=self.dp, resume=resume, extra=self._extra(),
                       spares=self.spares)

    def take_over(self, excluded: set[str], skip_steps: set[int]) -> TakenOver:
        """After the job's previous healer died: adopt its last attempt if it still runs, else stop what is left of
        it; go on with its hosts, dp degree and skipped batches (a host it left out stays out)."""
        adopted, killed = self.sup.take_over(self.token)
        last = Journal.of(RunPaths(Path(self.sup.cfg.run_dir)).journal).last_start()
        # NOTE: every host this healer has that the last attempt did not run on is a spare: in the same allocation
        # that is the configured spares; in a successor's (the healer's host was lost), the hosts that replace it.
        here = (*self.cfg.nodes, *self.cfg.spares)
        self.placement = self.placement.taken_over(tuple(last.nodes) if last else None, last.dp if last else None,
                                                   here, excluded, skip_steps)
        gone = tuple(n for n in (last.nodes if last else ()) if n not in here and n not in excluded)
        return TakenOver(killed=killed, nodes=self.nodes, dp=self.dp,
                         attempt=last.attempt if last is not None else None, adopted=adopted, elsewhere=gone)

    def replace_lost(self, lost: tuple[str, ...]) -> None:
        """Leave `lost` out without an incident (a take-over found them gone with no host_lost rule to open one
        with): a spare takes each one's place, as far as there are spares."""
        instead = dict(zip(lost, self.spares))
        nodes = tuple(instead.get(n, n) for n in self.nodes if n in instead or n not in lost)
        self.placement, _ = self.placement.moved_to(nodes, self.dp, ())

    def shutdown(self, grace: timedelta | None = None, hurry: Callable[[], bool] = lambda: False) -> None:
        """On the way out of `megaheal run` (Ctrl-C, SIGTERM, an error): no attempt starts any more, not even one a
        restart in flight was about to start, and the current one is stopped now, on the caller's thread (the
        worker may be busy with a diagnosis): SIGTERM, SIGKILL after `grace` (the coordinator's when None) or as
        soon as `hurry()` is true."""
        self.sup.close()
        self.sup.view.stopping(self.job)
        if self.across is not None:
            self.across.stop()
        self.sup.stop(self.token, grace, hurry)

    def close(self) -> None:
        """Stop the worker once the orders queued so far are carried out (the job itself is left as it is)."""
        self._orders.put(None)
        self._thread.join(timeout=300)

    def signal_rank(self, rank: int, sig: int) -> int:
        """Send `sig` to one rank of the current attempt (fault injection); returns its pid."""
        return self.sup.kill_rank(self.token, rank, sig)

    def poll(self) -> None:
        self.sup.poll()

    # ---- what the core reads ----------------------------------------------------------------------------

    def state(self) -> JobState:
        a = self.sup.attempt
        return JobState(job=self.job, nodes=self.nodes, spares=self.spares, dp=self.dp, valid_dp=self.cfg.valid_dp,
                        excluded=tuple(sorted(self.excluded)),
                        attempt=a.number if a is not None else None,
                        attempt_started_at=datetime.fromtimestamp(a.started_at, UTC) if a is not None else None,
                        running=a is not None and not a.done and not a.stopping,
                        succeeded=a is not None and a.succeeded, busy=self.busy,
                        warm_unavailable=self._warm_unavailable(),
                        replica_hosts=keeper_hosts(self.nodes) if self.sup.warm is not None else {},
                        total_steps=self.cfg.total_steps, replica_groups=self.cfg.replica_groups)

    def _warm_unavailable(self) -> str | None:
        """Why the next restart cannot be warm, or None (healer.decide.plans.restart_mode)."""
        a, warm = self.sup.attempt, self.sup.warm
        if warm is None:
            return "the job does not run warm"
        if a is None or a.warm is None or a.stopping or a.done:
            return "no warm generation runs"
        try:
            ready = len(warm.resumed_from(a.warm)) == len(a.warm.assign)
        except (RuntimeError, OSError) as exc:
            return f"the warm pool's store does not answer: {exc}"
        if not ready:
            return (f"attempt {a.number} has not resumed on every rank yet: what its processes hold is not trusted "
                    "(a crash during a restart restarts cold)")
        return None

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._pending > 0

    def checkpoint_steps(self) -> tuple[int, ...]:
        if self.sup.cfg.program is not None:
            return self.saved.saved_steps(self.job) if self.saved is not None else ()
        return tuple(c.step for c in list_checkpoints(RunPaths(Path(self.sup.cfg.run_dir)).checkpoints) if not verify(c))

    @property
    def records_steps(self) -> bool:
        return self.sup.cfg.program is None

    def first_step(self, attempt: int) -> int | None:
        return rank_records.first_step(self.sup.cfg.run_dir, attempt)

    def highest_step(self, attempt: int) -> int | None:
        return rank_records.highest_step(self.sup.cfg.run_dir, attempt)

    def first_bad_step(self, kind: str, attempt: int, detector_config: Any, seen: int | None = None) -> int | None:
        window = rank_records.attempt_window(self.sup.cfg.run_dir, attempt)
        if window is None:
            return None
        how = fault(kind).bad_step
        if how is BadStep.NONFINITE:
            return rank_records.first_nonfinite_step(self.sup.cfg.run_dir, window[0], attempt)
        if how is BadStep.SPIKE:
            return rank_records.first_spike_step(self.sup.cfg.run_dir, window[0], detector_config, seen, attempt)
        return None

    def rank_evidence(self, attempt: int) -> dict[str, Any] | None:
        found = self.sup.rank_evidence(self.cfg.evidence_timeout.total_seconds())
        return found if found.get("attempt") == attempt else None

    # ---- orders -----------------------------------------------------------------------------------------

    def stop(self, reason: str, grace: timedelta) -> None:
        log.warning("stopping %s: %s", self.job, reason)
        self.sup.view.stopping(self.job)
        self._submit(lambda: self.sup.stop(self.token, grace))

    def diagnose(self, nodes: list[str], runbook: str, stop_first: bool,
                 done: Callable[[list[HostVerdict]], None]) -> None:
        if stop_first:
            self.sup.view.stopping(self.job)

        def run() -> None:
            if stop_first:
                # NOTE: node-health wants the host idle (a process still holding a device fails it), and a job that
                # crashed or hangs cannot go on anyway.
                self.sup.stop(self.token, self.cfg.fault_grace)
            done(diagnose_nodes(self.sup.run_runbook, nodes, runbook, self.cfg.diagnosis_timeout))

        self._submit(run)

    def diagnose_across(self, nodes: list[str], runbook: str, done: Callable[[list[HostVerdict]], None]) -> None:
        # NOTE: a thread of its own, not the order queue: the job trains on meanwhile, and a crash or a lost host
        # must not wait minutes behind a network test to be restarted.
        def run() -> None:
            if self.across is None:
                verdicts = [HostVerdict(n, Status.ERROR, f"{runbook} runs across hosts; this launcher cannot run it",
                                        0.0) for n in nodes]
            else:
                verdicts = self.across(list(nodes), runbook)
            done(verdicts)

        threading.Thread(target=self._guarded, args=(run,), name="megaheal-diagnose-across", daemon=True).start()

    def restart(self, order: RestartOrder, done: Callable[[Started | Failed], None]) -> None:
        if not order.replica:
            self.sup.view.stopping(self.job)  # NOTE: a regroup stops no group but the ones that leave
        # NOTE: the hosts it leaves out are out from the order on, not once the old attempt is stopped: while it is
        # (its ranks hidden from the detectors), a host's lasting fault (a GPU that keeps its Xid) reads as no job's
        # and opened an incident of its own.
        self.placement = self.placement.leaving_out(order.nodes, order.released, order.keep_out)

        def run() -> None:
            try:
                done(self._restart(order))
            except (RuntimeError, OSError, ValueError, StopIteration) as exc:
                done(Failed(f"{type(exc).__name__}: {exc}"))

        self._submit(run)

    def _extra(self, skip_steps: tuple[int, ...] = ()) -> tuple[str, ...]:
        """The `--set` items of the next attempt beyond the run's own: the batches to skip and the tuned intervals."""
        return self.placement.skip_override(skip_steps) + (self.tuning.overrides() if self.tuning is not None else ())

    def _restart(self, order: RestartOrder) -> Started:
        cold_why = order.mode_why or "cold by the policy"
        if self.tuning is not None and not order.replica:  # a replica group's restart loses no job's work
            current = self.sup.attempt
            self.tuning.at_restart(Path(self.sup.cfg.run_dir), (current.number, current.started_at) if current else None,
                                   warm=order.warm, journal=self.sup.journal_event)
        if order.replica:
            try:
                return self._regroup(order)
            except NothingToJoin as exc:
                cold_why = f"replica groups could not be replaced alone: {exc}"
                log.warning("incident %d: %s; restarting cold", order.incident_id, cold_why)
                self.sup.view.stopping(self.job)
        if order.warm:
            try:
                return self._restart_warm(order)
            except WarmUnavailable as exc:
                cold_why = f"a warm restart was not possible: {exc}"
                log.warning("incident %d: %s; restarting cold", order.incident_id, cold_why)
        return self._restart_cold(order, cold_why)

    def _restart_warm(self, order: RestartOrder) -> Started:
        """The next attempt from the running one's processes (Coordinator.restart_warm), on the order's hosts (a spare
        in the place of a host that leaves); it waits, a bounded time, for every rank to say where it resumed from."""
        ordered = time.monotonic()
        placement, left_out = self.placement.moved_to(order.nodes, order.dp, order.released)
        doubts = self.drainer.witness(order.incident_id) if left_out and self.drainer is not None else None
        try:
            attempt = self.sup.restart_warm(self.token, placement.nodes, placement.dp,
                                            extra=self._extra(order.skip_steps),
                                            at_most_step=order.resume_step, why=order.mode_why,
                                            spares=placement.spares, replace_ranks=order.replace_ranks)
        except WarmUnavailable:
            if doubts is not None:
                doubts.cancel()
            raise
        self.placement = placement.skipping(order.skip_steps)
        planned = time.monotonic()
        assert attempt.warm is not None and self.sup.warm is not None
        deadline = time.monotonic() + WARM_READY_WAIT_S
        resumed: dict[str, str] = {}
        while time.monotonic() < deadline and not attempt.done and not self._failed_in(attempt.number):
            resumed = self.sup.warm.resumed_from(attempt.warm)
            if len(resumed) == len(attempt.warm.assign):
                break
            time.sleep(0.02)
        self.sup.warm_ready(attempt, resumed)
        if left_out and self.drainer is not None:
            # NOTE: once the new generation runs, on a thread of its own: the witnesses (seconds, for a host that
            # does not answer) and the scheduler's answer hold up neither the training nor the restart's record.
            threading.Thread(target=self._drain_left_out, args=(order.incident_id, left_out, doubts), daemon=True,
                             name="megaheal-drain").start()
        steps = {int(m.group(1)) for v in resumed.values() if (m := re.match(r"memory step (\d+)", v))}
        # NOTE: the ranks' own words when they fell back to the disk ("disk (replica of rank 3 kept by rank 5
        # failed its checksum at step 12) in 1.2 s", train/warm/worker.py), so the incident says why.
        disk = sorted({re.sub(r" in [0-9.]+ s$", "", v) for v in resumed.values() if v.startswith("disk")})
        resume = "memory" if not disk else next((d for d in disk if d != "disk"),
                                                "disk (no state in memory held by every rank)")
        taken = f"; standbys took rank(s) {sorted(attempt.warm.replaced)}" if attempt.warm.replaced else ""
        said = [float(m.group(1)) for v in resumed.values() if (m := re.search(r" in ([0-9.]+) s$", v))]
        stages = {"stop_s": round(planned - ordered, 3), **({"state_transfer_s": max(said)} if said else {})}
        from_step = min(steps) if steps and not disk else None
        if disk and self.sup.cfg.program is None:
            # What the ranks' `--resume auto` picked: the same choice a cold restart makes.
            choice = choose_resume(RunPaths(self.sup.cfg.run_dir).checkpoints)
            from_step = choice.checkpoint.step if choice.checkpoint is not None else 0
        return Started(attempt=attempt.number, at=datetime.fromtimestamp(attempt.started_at, UTC),
                       from_step=from_step, resume=resume, nodes=self.nodes,
                       dp=self.dp, mode="warm", mode_why=order.mode_why + taken, stages=stages)

    def _drain_left_out(self, incident_id: int, left_out: set[str], doubts: futures.Future | None) -> None:
        """Drain the hosts a warm restart left out that their incident proved bad (Drainer.left_out)."""
        drainer = self.drainer
        assert drainer is not None
        if doubts is not None:
            futures.wait([doubts], timeout=WITNESS_WAIT_S)

        def drain() -> None:
            drainer.left_out(incident_id, left_out, doubts)

        self._guarded(drain)

    def _failed_in(self, attempt: int) -> bool:
        """Whether a rank of `attempt` has failed (the crash that follows restarts cold: waiting on is pointless)."""
        return any(e.failed and e.job == self.job and e.attempt == attempt for e in self.sup.view.exits())

    def _restart_cold(self, order: RestartOrder, why: str) -> Started:
        # The witnesses of a silent host's loss are asked now, while the old attempt stops (healer/launchers/drain.py),
        # and heard before the next attempt starts: what they say is of the host as the healer found it, not as it may
        # be once the job runs again without it (a cut link restored). NOTE: a few seconds at most, and the stop of an
        # attempt on a host that does not answer takes about as long.
        ordered = time.monotonic()
        doubts = self.drainer.witness(order.incident_id) if self.drainer is not None else None
        self.sup.stop(self.token, self.cfg.fault_grace)
        if doubts is not None:
            futures.wait([doubts], timeout=WITNESS_WAIT_S)
        run_dir = self.sup.cfg.run_dir
        from_step: int | None
        if self.sup.cfg.program is not None:
            # A program resumes from its own checkpoints: told the step of a rollback's, else its own choice.
            resume, from_step = (program_resume(order.resume_step), order.resume_step)
            if order.resume_step is not None and self.saved is not None:
                self.saved.forget_saved_after(self.job, order.resume_step)
        elif order.resume_step is not None:
            chosen = next(c for c in list_checkpoints(RunPaths(run_dir).checkpoints)
                          if c.step == order.resume_step and not verify(c))
            resume, from_step = str(chosen.path), chosen.step
        else:
            # What --resume auto will pick: the same choice the ranks make.
            choice = choose_resume(RunPaths(run_dir).checkpoints)
            resume, from_step = "auto", choice.checkpoint.step if choice.checkpoint is not None else 0
        placement, left_out = self.placement.moved_to(order.nodes, order.dp, order.released)
        self.placement = placement.skipping(order.skip_steps)
        stopped = time.monotonic()
        try:
            attempt = self.sup.start(self.token, self.nodes, dp=self.dp, resume=resume,
                                     extra=self._extra(), spares=self.spares)
        finally:
            if left_out and self.drainer is not None:
                # NOTE: after the start, so the scheduler's answer never adds to the time to recover; whether the
                # start worked or not, the host stays proven bad.
                self.drainer.left_out(order.incident_id, left_out, doubts)
        return Started(attempt=attempt.number, at=datetime.fromtimestamp(attempt.started_at, UTC), from_step=from_step,
                       resume=resume, nodes=self.nodes, dp=self.dp, mode="cold", mode_why=why,
                       stages={"stop_s": round(stopped - ordered, 3)})

    def _submit(self, order: Callable[[], None]) -> None:
        with self._lock:
            self._pending += 1
        self._orders.put(order)

    def _work(self) -> None:
        while (order := self._orders.get()) is not None:
            try:
                self._guarded(order)
            finally:
                with self._lock:
                    self._pending -= 1

    @staticmethod
    def _guarded(order: Callable[[], None]) -> None:
        try:
            order()
        except Exception:  # noqa: BLE001 - NOTE: the worker must outlive a failed order; the order's own callback
            # reports what it can, this logs the rest
            log.error("a remediation order failed", exc_info=True)


def wait_idle(remediator: AgentRemediator, timeout_s: float) -> bool:
    """Wait until every queued order is carried out (tests, shutdown); False on timeout."""
    deadline = time.monotonic() + timeout_s
    while remediator.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    return not remediator.busy

