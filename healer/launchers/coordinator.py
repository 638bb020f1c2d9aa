"""The healer's side of an attempt run by node agents: it orders each host's agent to start its part (the first host
first: it picks the rendezvous port and says which), to stop, to signal a rank; what the processes do it learns from
the agents' batches (healer/observe/processes.py: ProcessView.report). It never touches a process itself.

It answers like the single-machine supervisor did (start, poll, stop, kill_rank, take_over, the attempt and its
history), so the remediator and the loop above it do not care where the hosts are. Every call that kills or
restarts work needs the run's token.
"""

from __future__ import annotations

import hmac
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from ground import kill
from ground.names import check_name
from healer.launchers.agent_client import AgentClient, AgentUnreachable, OrderFailed
from healer.launchers.journal import targets as journal_targets
from healer.launchers.warm_control import Generation, WarmControl, WarmSettings, WarmUnavailable
from healer.observe.processes import ProcessView
from wire import journal
from wire.orders import (
    AdoptOrder,
    EvidenceOrder,
    RunbookOrder,
    SignalOrder,
    StartOrder,
    StopOrder,
    Worker,
    WorkersOrder,
)
from wire.run_ids import pool_run_id, run_id
from wire.run_paths import RunPaths

log = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0


class Unauthorized(PermissionError):
    """A kill or restart was asked for without the run's token."""


@dataclass(slots=True)
class AgentRank:
    rank: int
    local_rank: int
    node: str
    pid: int
    started: float | None
    """The process's start time on its host (None: only known by its exit)."""


@dataclass(slots=True)
class AgentAttempt:
    number: int
    nodes: tuple[str, ...]
    started_at: float
    dp: int | None
    resume: str | None
    ranks: dict[int, AgentRank] = field(default_factory=dict)
    """pid -> rank, as the agents reported them."""
    ended: set[str] = field(default_factory=set)
    """Hosts whose part of the attempt has ended (their torchrun agent exited, or the host was lost)."""
    exit_codes: dict[str, int] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)
    """Hosts whose agent could not be reached when the attempt was stopped."""
    stopping: bool = False
    warm: Generation | None = None
    """The generation of the job's warm pool this attempt is (None: a torchrun attempt)."""
    superseded: bool = False
    """A warm restart took its place: its survivors train on in the next attempt."""

    @property
    def done(self) -> bool:
        return set(self.nodes) <= self.ended

    @property
    def succeeded(self) -> bool:
        return self.done and not self.lost and all(c == 0 for c in self.exit_codes.values()) and not self.stopping


class Coordinator:
    @dataclass(kw_only=True, slots=True)
    class Config:
        job: str
        """The job's name (its ranks report it; the detectors key on it)."""
        config: str
        """Training config path (on the shared filesystem: every host reads it)."""
        run_dir: Path
        """Shared by every attempt and host: checkpoints and the ranks' JSON lines."""
        nproc_per_node: int = 2
        """Ranks per host."""
        overrides: tuple[str, ...] = ()
        """`--set` items for every attempt (the dp degree is added per attempt)."""
        grace: timedelta = timedelta(seconds=30)
        """SIGTERM to SIGKILL in a graceful stop: time for the final checkpoint."""
        hosts_are_local: bool = False
        """Every host's processes are this machine's (local agents): at a take-over, what a host whose agent is gone
        left running is found from the journal and killed here, checked like every signal (ground.kill)."""
        warm: WarmSettings | None = None
        """Run the attempts as generations of warm workers that outlive them (healer/launchers/warm_control.py), so a
        restart can be warm; None: a torchrun agent per host and attempt."""

        def __post_init__(self) -> None:
            check_name(self.job, "job")
            if self.nproc_per_node < 1:
                raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
            if self.grace < timedelta(0):
                raise ValueError(f"grace must be >= 0, got {self.grace}")

    def __init__(self, cfg: Config, view: ProcessView, token: str, agents: dict[str, AgentClient] | None = None,
                 env: dict[str, str] | None = None, clock: Callable[[], float] = time.time) -> None:
        """`agents`: one client per host (spares included; filled in when the launcher has started them); `env`:
        GLOO_/NCCL_/... settings for every rank."""
        if len(token) < 16:
            raise ValueError("the coordinator needs the run's token (at least 16 characters)")
        self.cfg, self.view, self.clock = cfg, view, clock
        self._paths = RunPaths(Path(cfg.run_dir))
        self.agents: dict[str, AgentClient] = dict(agents or {})
        self.env = dict(env or {})
        self._token = token
        self.attempt: AgentAttempt | None = None
        self.history: list[AgentAttempt] = []
        self._first_number = 0
        self.closed = False
        """Set on the way out (`close`): no attempt starts any more, so a restart in flight cannot outlive us."""
        self._lock = threading.RLock()
        self._leftovers_stopping: set[tuple[str, int]] = set()
        """(host, attempt) of each older attempt found still running that is being (or was) stopped there."""
        self.warm = (WarmControl(cfg.warm, config=cfg.config, run_dir=str(Path(cfg.run_dir).absolute()),
                                 nproc_per_node=cfg.nproc_per_node) if cfg.warm is not None else None)

    def _check(self, token: str) -> None:
        if not hmac.compare_digest(token.encode(), self._token.encode()):
            raise Unauthorized("killing or restarting training needs the run's token")

    def _order_id(self, kind: str, attempt: int, node: str, extra: str = "") -> str:
        return f"{self.cfg.job}-{attempt}:{kind}:{node}{extra}"

    # ---- start ---------------------------------------------------------------------------------------

    def start(self, token: str, nodes: tuple[str, ...], dp: int | None = None, resume: str | None = "auto",
              extra: tuple[str, ...] = ()) -> AgentAttempt:
        """Start the next attempt on `nodes` (the previous one must be over). RuntimeError when a host's agent
        refuses or cannot be reached (the attempt is then stopped where it did start)."""
        self._check(token)
        with self._lock:
            if self.closed:
                raise RuntimeError(f"the coordinator of {self.cfg.job} is shutting down: no new attempt")
            if self.attempt is not None and not self.attempt.done:
                raise RuntimeError(f"attempt {self.attempt.number} still runs; stop it first")
            number = self.attempt.number + 1 if self.attempt is not None else self._first_number
            overrides = self.overrides(dp, extra)
            self.view.started(self.cfg.job, number, tuple(nodes), self.clock())
            self.attempt = AgentAttempt(number=number, nodes=tuple(nodes), started_at=self.clock(), dp=dp, resume=resume)
            self.history.append(self.attempt)
            self._journal(journal.Start(job=self.cfg.job, attempt=number, at=self.attempt.started_at,
                                        nodes=list(nodes), dp=dp, resume=resume,
                                        agent_urls={n: self.agents[n].url for n in nodes},
                                        warm=journal.WarmNote(formation=True, formed_in=number) if self.warm else None))
        if self.warm is not None:
            return self._form_warm(token, number, nodes, resume, overrides)
        failures: list[Exception] = []

        def launch(node_rank: int, endpoint: str | None) -> str:
            node = nodes[node_rank]
            result = self.agents[node].run(self.start_order(number, nodes, node_rank, endpoint, resume, overrides),
                                           START_TIMEOUT_S)
            # Each host's torchrun and when it started: what a take-over checks before it signals that pid.
            self._journal(journal.Launched(attempt=number, at=self.clock(), agents={node: result.pid},
                                           agents_started={node: result.started}))
            return str(result.rdzv_endpoint)

        def launch_rest(node_rank: int) -> None:
            try:
                launch(node_rank, endpoint)
            except (AgentUnreachable, OrderFailed) as exc:
                failures.append(exc)

        try:
            # The first host picks the rendezvous endpoint (it holds the store); the others join it, all at once.
            endpoint = launch(0, None)
            _on_each(list(range(1, len(nodes))), launch_rest)
            if failures:
                raise failures[0]
        except (AgentUnreachable, OrderFailed) as exc:
            log.error("attempt %d of %s could not start: %s", number, self.cfg.job, exc)
            self.stop(token, timedelta(0))
            raise RuntimeError(f"attempt {number} could not start: {exc}") from exc
        log.info("attempt %d of %s started on %s (resume %s)", number, self.cfg.job, ", ".join(nodes), resume)
        return self.attempt

    def _form_warm(self, token: str, number: int, nodes: tuple[str, ...], resume: str | None,
                   overrides: tuple[str, ...]) -> AgentAttempt:
        """Attempt `number` as a new warm pool: every host starts its workers, and once all are up the generation's
        plan starts them (from the disk, as `resume` says)."""
        assert self.warm is not None and self.attempt is not None
        gen = self.warm.form(number, nodes, "formation")
        self.attempt.warm = gen
        try:
            self._order_warm(number, nodes, gen, resume, overrides)
            self.warm.wait_up(list(gen.assign))
        except (AgentUnreachable, OrderFailed, RuntimeError) as exc:
            log.error("attempt %d of %s could not start: %s", number, self.cfg.job, exc)
            self.stop(token, timedelta(0))
            raise RuntimeError(f"attempt {number} could not start: {exc}") from exc
        self.warm.publish(gen, overrides=overrides, disk_resume=resume)
        log.info("attempt %d of %s started warm-capable on %s (a new pool; resume %s)", number, self.cfg.job,
                 ", ".join(nodes), resume)
        return self.attempt

    def _order_warm(self, number: int, nodes: tuple[str, ...], gen: Generation, resume: str | None,
                    overrides: tuple[str, ...]) -> None:
        """Each host's start order of a warm generation, all at once; the first failure is raised."""
        assert self.warm is not None
        parts = self.warm.start_orders(gen, nodes)
        failures: list[Exception] = []

        def order(node_rank: int) -> None:
            node = nodes[node_rank]
            order = msgspec.structs.replace(self.start_order(number, nodes, node_rank, None, resume, overrides),
                                            warm=parts[node])
            try:
                self.agents[node].run(order, START_TIMEOUT_S)
            except (AgentUnreachable, OrderFailed) as exc:
                failures.append(exc)

        _on_each(list(range(len(nodes))), order)
        if failures:
            raise failures[0]

    def restart_warm(self, token: str, nodes: tuple[str, ...], dp: int | None, extra: tuple[str, ...] = (),
                     at_most_step: int | None = None, why: str = "") -> AgentAttempt:
        """The next attempt from the running one without stopping it: its live ranks keep their processes and
        state, a standby takes each rank that is gone, and all resume from the newest snapshot they hold in memory
        (at or before `at_most_step`: a rollback). WarmUnavailable, with nothing changed, when it cannot be made
        (no warm pool, no standby for a lost rank, a host that does not answer, another host set)."""
        self._check(token)
        if self.warm is None:
            raise WarmUnavailable("the job does not run warm")
        with self._lock:
            if self.closed:
                raise RuntimeError(f"the coordinator of {self.cfg.job} is shutting down: no new attempt")
            old = self.attempt
            if old is None or old.warm is None or old.stopping:
                raise WarmUnavailable("the current attempt is not a warm generation that runs")
            number = old.number + 1
        workers: dict[str, list[Worker]] = {}

        def ask(node: str) -> None:
            try:
                answer = self._quick(node).run(WorkersOrder(id=self._order_id("workers", number, node)), 5)
                workers[node] = answer.workers
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("warm restart: the workers of %s: %s", node, exc)

        _on_each(list(nodes), ask)
        gen = self.warm.replace(number, nodes, workers, why)
        try:
            self.warm.wait_up(list(gen.replaced.values()), self.warm.settings.standby_wait_s)
        except RuntimeError as exc:
            raise WarmUnavailable(str(exc)) from exc
        overrides = self.overrides(dp, extra)
        # NOTE: the plan first: every survivor leaves the old generation as soon as it reads it (a collective with the
        # dead rank would hold it up to the collective timeout), while the agents are told below.
        self.warm.publish(gen, overrides=overrides, disk_resume="auto", at_most_step=at_most_step)
        now = self.clock()
        with self._lock:
            old.superseded, old.ended = True, set(old.nodes)
            self.attempt = AgentAttempt(number=number, nodes=tuple(nodes), started_at=now, dp=dp, resume="memory",
                                        warm=gen)
            self.history.append(self.attempt)
            self._journal(journal.End(attempt=old.number, at=now, stopped=False, superseded=True))
            self._journal(journal.Start(job=self.cfg.job, attempt=number, at=now, nodes=list(nodes), dp=dp,
                                        resume="memory", agent_urls={n: self.agents[n].url for n in nodes},
                                        warm=journal.WarmNote(replaced=gen.replaced, why=why,
                                                              formed_in=self.warm.formed_in)))
        try:
            self._order_warm(number, nodes, gen, "auto", overrides)
        except (AgentUnreachable, OrderFailed) as exc:
            # The generation was planned: a host that did not take its order is lost to it (a crash incident follows,
            # and the restart after it is cold).
            log.error("warm restart %d of %s: a host did not take its order: %s", number, self.cfg.job, exc)
        # NOTE: after the agents took their orders: a report of the old attempt that comes after this is a leftover
        # to stop, and a stop of the old attempt must find the new one there (then it does nothing).
        self.view.started(self.cfg.job, number, tuple(nodes), now)
        log.warning("attempt %d of %s: warm restart (%s; ranks replaced: %s)", number, self.cfg.job, why,
                    {r: w for r, w in gen.replaced.items()} or "none")
        return self.attempt

    def warm_ready(self, attempt: AgentAttempt, resumed: dict[str, str]) -> None:
        """Journal where each rank of a warm generation took its state from, and how long its group and state took
        (the workers' own words: "memory step 12 in 0.310 s"; bench/recovery.py reads them)."""
        self._journal(journal.WarmReady(attempt=attempt.number, at=self.clock(), resumed=resumed))

    def overrides(self, dp: int | None, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The `--set` items of an attempt: the job's name first (the ranks report under it), the run's, the dp degree
        of the attempt, and `extra` (batches to skip after a rollback)."""
        return (f"job={self.cfg.job}", *self.cfg.overrides, *((f"parallel.dp={dp}",) if dp is not None else ()), *extra)

    def start_order(self, number: int, nodes: tuple[str, ...], node_rank: int, endpoint: str | None,
                    resume: str | None, overrides: tuple[str, ...]) -> StartOrder:
        """The start order of host `nodes[node_rank]` for attempt `number`."""
        node = nodes[node_rank]
        return StartOrder(id=self._order_id("start", number, node), job=self.cfg.job, attempt=number,
                          nnodes=len(nodes), node_rank=node_rank, nproc_per_node=self.cfg.nproc_per_node,
                          rdzv_endpoint=endpoint, config=self.cfg.config, run_dir=str(Path(self.cfg.run_dir).absolute()),
                          resume=resume, overrides=list(overrides), env=self.env)

    # ---- watch ---------------------------------------------------------------------------------------

    def poll(self) -> None:
        """Bring the attempt up to date with what the agents reported (cheap: in memory)."""
        with self._lock:
            a = self.attempt
            if a is None:
                return
            found = len(a.ranks)
            for node, pid, rank, local, started in self.view.reported_ranks(self.cfg.job):
                a.ranks.setdefault(pid, AgentRank(rank, local, node, pid, started))
            for node, code in self.view.ended_nodes(self.cfg.job).items():
                if node in a.nodes and node not in a.ended:
                    a.ended.add(node)
                    a.exit_codes[node] = code
                    if a.done:
                        self._journal(journal.End(attempt=a.number, at=self.clock(), exit_codes=dict(a.exit_codes),
                                                  stopped=a.stopping))
                        if a.succeeded and self.warm is not None:
                            self.warm.end(a.number)  # the job is done: the standbys leave
            for node, old in self.view.leftovers(self.cfg.job).items():
                self._stop_leftover(node, old)
            if len(a.ranks) > found:
                # `started`: for a take-over's checks; `nodes`: which host each rank ran on (the pages' heat maps).
                self._journal(journal.Ranks(
                    attempt=a.number, at=self.clock(), ranks={str(pid): r.rank for pid, r in a.ranks.items()},
                    started={str(pid): r.started for pid, r in a.ranks.items() if r.started is not None},
                    nodes={str(r.rank): r.node for r in a.ranks.values()}))

    def reattach(self, node: str, client: AgentClient) -> int | None:
        """`node` has a new agent (`client`; its old one died): orders go to it from now on, and it takes on the
        current attempt's part there if that still runs (AdoptOrder). The attempt it adopted, or None."""
        with self._lock:
            self.agents[node] = client
            a = self.attempt
            if a is None or node not in a.nodes or node in a.ended or a.stopping:
                return None
            number, node_rank = a.number, a.nodes.index(node)
        try:
            client.run(AdoptOrder(id=self._order_id("adopt", number, node, f":{time.time_ns()}"), job=self.cfg.job,
                                  attempt=number, node_rank=node_rank), 30)
        except OrderFailed as exc:
            log.warning("the new agent of %s did not find attempt %d running there: %s", node, number, exc)
            return None
        self._journal(journal.Adopted(attempt=number, node=node, at=self.clock()))
        log.warning("the new agent of %s took on attempt %d", node, number)
        return number

    def _stop_leftover(self, node: str, attempt: int) -> None:
        """An older attempt still runs on `node` (its agent was cut off when the healer stopped that attempt, and is
        back): stop it there, off the caller's thread."""
        client = self.agents.get(node)
        if client is None:
            return
        with self._lock:
            # NOTE: the agent goes on reporting the attempt until the stop is done: one stop (and one journal line) per
            # leftover, not one per report (two came 0.16 s apart on a loaded machine).
            if (node, attempt) in self._leftovers_stopping:
                return
            self._leftovers_stopping.add((node, attempt))

        def stop() -> None:
            try:
                client.run(StopOrder(id=self._order_id("stop", attempt, node, ":leftover"), attempt=attempt, grace_s=0),
                           60)
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("attempt %d still runs on %s and could not be stopped: %s", attempt, node, exc)
                with self._lock:
                    self._leftovers_stopping.discard((node, attempt))  # the next report of it tries again
                return
            self._journal(journal.LeftoverStopped(attempt=attempt, node=node, at=self.clock()))
            log.warning("attempt %d was still running on %s (cut off when it was stopped): stopped now", attempt, node)

        threading.Thread(target=stop, name=f"megaheal-leftover-{node}", daemon=True).start()

    # ---- stop ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """No attempt starts from now on (`megaheal run` is on its way out): a restart ordered before cannot start
        one after the job was stopped."""
        with self._lock:
            self.closed = True

    def stop(self, token: str, grace: timedelta | None = None, hurry: Callable[[], bool] = lambda: False) -> None:
        """Every host stops its part (SIGTERM, SIGKILL after `grace`, or at once when `hurry()` turns true: a second
        Ctrl-C); returns once all reported it ended, or its agent could not be reached (a lost host: nothing of the
        attempt can run there with its peers gone)."""
        self._check(token)
        with self._lock:
            a = self.attempt
            if a is None:
                return
            self.view.stopping(self.cfg.job)
            a.stopping = a.stopping or not a.done
        grace_s = (self.cfg.grace if grace is None else grace).total_seconds()

        def order_stop(node: str) -> None:
            try:
                self._quick(node).order(StopOrder(id=self._order_id("stop", a.number, node), attempt=a.number,
                                                  grace_s=grace_s))
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("stopping attempt %d on %s: %s; the host counts as lost", a.number, node, exc)
                with self._lock:
                    a.lost.add(node)
                    a.ended.add(node)

        _on_each([n for n in a.nodes if n not in a.ended], order_stop)
        deadline = time.monotonic() + grace_s + 30
        hurried = grace_s == 0
        while not a.done and time.monotonic() < deadline:
            if not hurried and hurry():
                hurried = True
                self._hurry(a)
            time.sleep(0.05)
            self.poll()
        if not a.done:
            missing = sorted(set(a.nodes) - a.ended)
            log.warning("attempt %d: no end reported by %s after the stop; counted as lost", a.number, missing)
            with self._lock:
                a.lost |= set(missing)
                a.ended |= set(missing)
            self._journal(journal.End(attempt=a.number, at=self.clock(), exit_codes=dict(a.exit_codes), stopped=True,
                                      lost=missing))
        if self.warm is not None:
            self.warm.forget()  # every host stopped its whole pool: the next attempt forms a new one

    def _hurry(self, a: AgentAttempt) -> None:
        """A stop with no grace to every host still stopping: it cuts short the stop in progress there."""
        def order(node: str) -> None:
            try:
                self._quick(node).order(StopOrder(id=self._order_id("stop", a.number, node, ":now"), attempt=a.number,
                                                  grace_s=0))
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("hurrying the stop of attempt %d on %s: %s", a.number, node, exc)

        _on_each(sorted(set(a.nodes) - a.ended), order)

    def _quick(self, node: str) -> AgentClient:
        """The host's client for an order that only has to be queued (the agent answers at once): a host that does
        not answer within seconds is taken as lost instead of holding up the stop of every other host."""
        return replace(self.agents[node], timeout_s=min(self.agents[node].timeout_s, 2.0), attempts=2)

    def kill_rank(self, token: str, rank: int, sig: int) -> int:
        """Send `sig` to one rank of the current attempt, through its host's agent (fault injection); its pid."""
        self._check(token)
        node = self.node_of_rank(rank)
        a = self.attempt
        assert a is not None
        name = signal.Signals(sig).name
        order = SignalOrder(id=self._order_id("signal", a.number, node, f":{rank}:{name}:{time.time_ns()}"),
                            attempt=a.number, rank=rank, signal=name)  # type: ignore[arg-type]
        return self.agents[node].run(order, 10).pid

    def run_runbook(self, node: str, runbook: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """`megaheal diagnose RUNBOOK --json` on `node`, through its agent, in the environment its ranks get."""
        order = RunbookOrder(id=f"runbook:{node}:{runbook}:{time.time_ns()}", runbook=runbook, timeout_s=timeout_s)
        try:
            result = self.agents[node].run(order, timeout_s + 30)
        except (AgentUnreachable, OrderFailed) as exc:
            raise TimeoutError(str(exc)) from exc
        if result.timeout or result.returncode is None:
            raise TimeoutError(f"{runbook} on {node} ran past {timeout_s:g} s")
        return subprocess.CompletedProcess(["diagnose", runbook], result.returncode, result.stdout, result.stderr)

    def rank_evidence(self, timeout_s: float) -> dict[str, Any]:
        """What every rank of the current attempt is doing, from each host's agent at once (stacks, states, phases;
        nothing is signalled): {"attempt", "ranks": [... each with its "node"], "unreached": {host: why}}."""
        with self._lock:
            a = self.attempt
            nodes = [n for n in a.nodes if n not in a.ended] if a is not None else []
        if a is None:
            return {"attempt": None, "ranks": [], "unreached": {}}
        found: list[dict[str, Any]] = []
        unreached: dict[str, str] = {}

        def ask(node: str) -> None:
            order = EvidenceOrder(id=self._order_id("evidence", a.number, node, f":{time.time_ns()}"),
                                  attempt=a.number, timeout_s=timeout_s)
            try:
                answer = self.agents[node].run(order, timeout_s + 15)
            except (AgentUnreachable, OrderFailed) as exc:
                unreached[node] = str(exc)[:300]
                return
            found.extend({**r, "node": node} for r in answer.ranks)

        _on_each(nodes, ask)
        return {"attempt": a.number, "ranks": sorted(found, key=lambda r: (r.get("rank") is None, r.get("rank"))),
                "unreached": unreached}

    def rank_pids(self) -> list[int]:
        return [s.pid for s in self.view.states() if s.job == self.cfg.job]

    def node_of_rank(self, rank: int) -> str:
        with self._lock:
            a = self.attempt
            node = next((r.node for r in (a.ranks.values() if a else []) if r.rank == rank), None)
        if node is None:
            raise LookupError(f"rank {rank} is not running")
        return node

    def ranks_found(self) -> int:
        with self._lock:
            return len(self.attempt.ranks) if self.attempt else 0

    # ---- take over -----------------------------------------------------------------------------------

    def take_over(self, token: str) -> tuple[bool, tuple[int, ...]]:
        """After the job's previous healer died (its agents outlived it): adopt its last attempt where it still runs on
        every host (the job goes on, nothing restarts), else stop what is left of it (the job then resumes from its
        newest good checkpoint). Numbers the next attempt after it. Whether the attempt was adopted, and the pids
        killed here (of hosts whose agent was gone, when they are this machine's)."""
        self._check(token)
        past = journal.Journal.of(self._paths.journal)
        last = past.last_attempt()
        if last is None:
            return False, ()
        self._first_number = last + 1
        mine = past.of_attempt(last)
        start = next((e for e in mine if isinstance(e, journal.Start)), None)
        if start is None or any(isinstance(e, journal.End) for e in mine):
            return False, ()
        nodes = tuple(start.nodes)
        # NOTE: a warm generation cannot be adopted: its pool's store lived in the healer that died, so no next
        # generation could be planned for it. It is stopped, and the job resumes cold.
        warm = start.warm
        if warm is None and self._runs_everywhere(last, nodes):
            with self._lock:
                self.attempt = AgentAttempt(number=last, nodes=nodes, started_at=start.at, dp=start.dp,
                                            resume=start.resume)
                self.history = [self.attempt]
                self.view.started(self.cfg.job, last, nodes, self.clock())
            log.warning("took over %s: attempt %d still runs on %s: adopted", self.cfg.job, last, ", ".join(nodes))
            return True, ()
        unreached = []
        for node in nodes:
            try:
                if node not in self.agents:
                    raise AgentUnreachable(f"no agent for {node}")
                result = self.agents[node].run(StopOrder(id=self._order_id("stop", last, node, ":take-over"),
                                                         attempt=last, grace_s=0.5), 60)
                if result.stopped != last:
                    # A new agent on that host (the old one died): it never ran the attempt, and cannot stop it.
                    raise AgentUnreachable(f"the agent of {node} does not know attempt {last}")
            except (AgentUnreachable, OrderFailed) as exc:
                log.warning("take-over: stopping attempt %d on %s: %s", last, node, exc)
                unreached.append(node)
        killed: list[int] = []
        if unreached and self.cfg.hosts_are_local:
            # NOTE: an agent that died with the healer leaves its torchrun and ranks running (their own session):
            # the journal names them, and each is killed only if it is still that process of that attempt.
            # The workers of a warm pool carry the run id of the attempt that formed it.
            rid = pool_run_id(self.cfg.job, warm.formed_in) if warm is not None and warm.formed_in is not None \
                else run_id(self.cfg.job, last)
            targets = journal_targets(mine, rid)
            for t in targets:
                kill.send(t, signal.SIGKILL)
            kill.wait_gone(targets, timeout_s=30)
            killed = [t.pid for t in targets]
        self._journal(journal.End(attempt=last, at=self.clock(), stopped=True, taken_over=True, killed=killed,
                                  lost=unreached))
        log.warning("took over %s: attempt %d was left by the previous healer; stopped (%d process(es) of hosts "
                    "without an agent killed)", self.cfg.job, last, len(killed))
        return False, tuple(killed)

    def _runs_everywhere(self, attempt: int, nodes: tuple[str, ...]) -> bool:
        for node in nodes:
            try:
                report = self.agents[node].state()["attempt"] if node in self.agents else None
            except (AgentUnreachable, OrderFailed):
                return False
            if report is None or report["attempt"] != attempt or report["ended"] or report["stopping"]:
                return False
        return True

    def _journal(self, event: journal.Event) -> None:
        journal.append(self._paths.journal, event)


T = TypeVar("T")


def _on_each(items: list[T], act: Callable[[T], None]) -> None:
    """`act` on every host at once (one slow or lost host must not hold up the others; a cluster has thousands)."""
    if len(items) <= 1:
        for item in items:
            act(item)
        return
    with ThreadPoolExecutor(max_workers=min(64, len(items)), thread_name_prefix="megaheal-order") as pool:
        list(pool.map(act, items))
