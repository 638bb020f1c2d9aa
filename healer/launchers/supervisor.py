"""The supervisor: runs attempts of one training job on chosen nodes, watches their processes, and stops
them gracefully.

- start(nodes, ...): a new attempt through the launcher, resuming from the newest good checkpoint (or a
  given one), with the node set and dp degree the remediation chose;
- poll(): maps each node's workers to their global ranks, samples their kernel state and CPU time into the
  ProcessView (a SIGSTOPped rank shows as 'T'), and when an agent ends, records every rank's exit with its
  exit code or signal (from the agent's failure report) and the tail of its log;
- stop(grace): SIGTERM to every rank (the trainer saves a final checkpoint and exits 0), SIGKILL to whatever
  is left after `grace`, then the agents. Exits during a stop are marked expected: they are not crashes.

Killing and restarting work needs the healer token: every such method takes it and refuses a wrong one.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from healer.jsonl import append_jsonl, read_jsonl
from megaheal import procfs
from megaheal.names import check_name
from healer.launchers import journal, kill
from healer.launchers.agent_log import parse_failures
from healer.launchers.local import Launcher, LaunchSpec, NodeHandle
from healer.core.processes import (
    MAX_TAIL_LINES,
    ProcessExit,
    ProcessState,
    ProcessView,
)

log = logging.getLogger(__name__)


class Unauthorized(PermissionError):
    """A kill or restart was asked for without the healer token."""


@dataclass(slots=True)
class _Rank:
    rank: int
    local_rank: int
    node: str
    pid: int
    started: float
    """When the process started (procfs start time): with the pid and the run id, what a signal is checked against."""

    def target(self, run_id: str) -> kill.Target:
        return kill.Target(self.pid, self.started, run_id)


@dataclass(slots=True)
class Attempt:
    number: int
    spec: LaunchSpec
    handles: list[NodeHandle]
    started_at: float
    ranks: dict[int, _Rank] = field(default_factory=dict)
    """pid -> rank, as found under the agents."""
    ended: set[str] = field(default_factory=set)
    """Nodes whose agent has exited."""
    exit_codes: dict[str, int] = field(default_factory=dict)
    stopping: bool = False
    recorded: set[int] = field(default_factory=set)
    """Ranks whose exit is already in the view."""
    vanished: dict[int, bool] = field(default_factory=dict)
    """Ranks recorded as vanished (reaped by their agent before their status was read), with whether their exit
    was expected: the agent's failure report, when it comes, says how they died."""

    @property
    def done(self) -> bool:
        return len(self.ended) == len(self.handles)

    @property
    def run_id(self) -> str:
        return self.spec.run_id

    @property
    def succeeded(self) -> bool:
        return self.done and all(code == 0 for code in self.exit_codes.values()) and not self.stopping


class Supervisor:
    @dataclass(kw_only=True, slots=True)
    class Config:
        job: str
        """The job's name (its ranks report it; the detectors key on it)."""
        config: str
        """Training config path."""
        run_dir: Path
        """Shared by every attempt: checkpoints and the ranks' JSON lines."""
        nproc_per_node: int = 2
        """Ranks per node."""
        overrides: tuple[str, ...] = ()
        """`--set` items for every attempt (the dp degree is added per attempt)."""
        grace: timedelta = timedelta(seconds=30)
        """SIGTERM to SIGKILL in a graceful stop: time for the final checkpoint."""
        tail_lines: int = MAX_TAIL_LINES
        """Log lines kept per exited rank."""

        def __post_init__(self) -> None:
            check_name(self.job, "job")
            if self.nproc_per_node < 1:
                raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
            if self.grace < timedelta(0):
                raise ValueError(f"grace must be >= 0, got {self.grace}")
            if not 1 <= self.tail_lines <= MAX_TAIL_LINES:
                raise ValueError(f"tail_lines must be in 1..{MAX_TAIL_LINES}, got {self.tail_lines}")

    def __init__(self, cfg: Config, launcher: Launcher, view: ProcessView, token: str,
                 sockets: dict[str, str] | None = None, clock: Callable[[], float] = time.time) -> None:
        if not token:
            raise ValueError("the supervisor needs the healer token")
        self.cfg, self.launcher, self.view, self.clock = cfg, launcher, view, clock
        self._token = token
        self.sockets = dict(sockets or {})
        self.attempt: Attempt | None = None
        self.history: list[Attempt] = []
        self._first_number = 0
        """The number of the first attempt this supervisor starts (after a take-over: the next one)."""
        self.closed = False
        """Set on the way out (`close`): no attempt starts any more, so a restart in flight cannot outlive us."""
        self._lock = threading.RLock()

    def _check(self, token: str) -> None:
        if not hmac.compare_digest(token.encode(), self._token.encode()):
            raise Unauthorized("killing or restarting training needs the healer token")

    # ---- start ---------------------------------------------------------------------------------------

    def start(self, token: str, nodes: tuple[str, ...], dp: int | None = None, resume: str | None = "auto",
              extra: tuple[str, ...] = ()) -> Attempt:
        """Start the next attempt on `nodes` (the previous one must be over)."""
        self._check(token)
        with self._lock:
            if self.closed:
                raise RuntimeError(f"the supervisor of {self.cfg.job} is shutting down: no new attempt")
            if self.attempt is not None and not self.attempt.done:
                raise RuntimeError(f"attempt {self.attempt.number} still runs; stop it first")
            number = self.attempt.number + 1 if self.attempt is not None else self._first_number
            overrides = self.cfg.overrides + ((f"parallel.dp={dp}",) if dp is not None else ()) + extra
            spec = LaunchSpec(job=self.cfg.job, attempt=number, nodes=nodes, nproc_per_node=self.cfg.nproc_per_node,
                              config=self.cfg.config, overrides=(f"job={self.cfg.job}", *overrides),
                              run_dir=self.cfg.run_dir, resume=resume, sockets=self.sockets)
            self.view.started(self.cfg.job, number)
            handles = self.launcher.start(spec)
            self.attempt = Attempt(number=number, spec=spec, handles=handles, started_at=self.clock())
            self.history.append(self.attempt)
            # The agents' start times: a healer that takes over checks them before it signals those pids.
            self._journal({"event": "start", "job": self.cfg.job, "attempt": number, "at": self.attempt.started_at,
                           "nodes": list(nodes), "dp": dp, "resume": resume,
                           "agents": {h.node: h.process.pid for h in handles},
                           "agents_started": {h.node: procfs.start_time(h.process.pid) for h in handles}})
            log.info("attempt %d of %s started on %s (resume %s)", number, self.cfg.job, ", ".join(nodes), resume)
            return self.attempt

    # ---- watch ---------------------------------------------------------------------------------------

    def poll(self) -> None:
        """One look at the processes (cheap: /proc reads); records exits and states into the view."""
        with self._lock:
            a = self.attempt
            if a is None or a.done:
                return
            now = self.clock()
            states = []
            found = len(a.ranks)
            for h in a.handles:
                if h.node in a.ended:
                    continue
                for pid in procfs.children(h.process.pid):
                    if pid not in a.ranks and (rank := procfs.worker_rank(pid)) is not None:
                        # NOTE: a worker of this attempt (its run id), and when it started: every signal to it
                        # later is checked against both, so a pid reused after it died is never signalled.
                        if (t := kill.identify(pid, a.run_id)) is None:
                            continue
                        env_local = procfs.environ(pid).get("LOCAL_RANK", "0")
                        a.ranks[pid] = _Rank(rank, int(env_local) if env_local.isdigit() else 0, h.node, pid,
                                             t.started)
                for pid, r in a.ranks.items():
                    if r.node != h.node or r.rank in a.recorded:
                        continue
                    st = procfs.stat(pid)
                    if st is not None and st.state != "Z":
                        states.append(ProcessState(job=self.cfg.job, attempt=a.number, node=h.node, rank=r.rank,
                                                   pid=pid, state=st.state, cpu_seconds=st.cpu_seconds, sampled_at=now))
                    elif h.process.poll() is None:
                        # NOTE: the agent reports exit statuses only after stopping its other workers, which can
                        # take its whole 30 s SIGTERM grace: a rank that died is recorded now, with its status
                        # when it is still a zombie, as `vanished` when the agent has reaped it already.
                        self._rank_ended(a, h, r, st, now)
                code = h.process.poll()
                if code is not None:
                    self._agent_ended(a, h, code, now)
            if len(a.ranks) > found:
                self.view.found(self.cfg.job, frozenset(a.ranks))
                # A healer that comes back after dying must find (and stop) the processes it left behind.
                # `nodes`: which host each rank ran on, for the pages' heat maps (a rank's own records name the
                # machine, and on one machine every local "host" is the same machine).
                self._journal({"event": "ranks", "attempt": a.number, "at": now,
                               "ranks": {str(pid): r.rank for pid, r in a.ranks.items()},
                               "started": {str(pid): r.started for pid, r in a.ranks.items()},
                               "nodes": {str(r.rank): r.node for r in a.ranks.values()}})
            self.view.update_states(states)

    def _agent_ended(self, a: Attempt, h: NodeHandle, code: int, now: float) -> None:
        a.ended.add(h.node)
        a.exit_codes[h.node] = code
        h.close_log()
        lines = _tail(h.log_path, 400)
        failures = {f.rank: f for f in parse_failures(lines)}
        ranks = [r for r in a.ranks.values() if r.node == h.node]
        for r in ranks:
            f = failures.get(r.rank)
            if r.rank in a.recorded and not (f is not None and r.rank in a.vanished):
                continue
            a.recorded.add(r.rank)
            expected = a.vanished.pop(r.rank) if r.rank in a.vanished else a.stopping
            self.view.record_exit(ProcessExit(
                job=self.cfg.job, attempt=a.number, node=h.node, rank=r.rank, pid=r.pid, at=now,
                exit_code=(f.exit_code if f else 0), signal=f.signal if f else None,
                log_tail=tuple(self.rank_log_tail(h, r.local_rank)), expected=expected))
        if code != 0 and not failures:
            # The agent itself failed (e.g. the rendezvous): its own log is the evidence.
            self.view.record_exit(ProcessExit(job=self.cfg.job, attempt=a.number, node=h.node, rank=None,
                                              pid=h.process.pid, at=now, exit_code=code if code >= 0 else None,
                                              signal=-code if code < 0 else None,
                                              log_tail=tuple(lines[-self.cfg.tail_lines:]), expected=a.stopping))
        log.info("attempt %d: agent of %s exited with %d (%d rank failure(s) reported)", a.number, h.node, code,
                 len(failures))
        if a.done:
            self._journal({"event": "end", "attempt": a.number, "at": now, "exit_codes": a.exit_codes,
                           "stopped": a.stopping})

    def _journal(self, entry: dict[str, object]) -> None:
        """`<run_dir>/supervisor/attempts.jsonl`: when each attempt started and ended (the goodput ledger's clock)."""
        append_jsonl(journal.path(self.cfg.run_dir), entry)

    def _rank_ended(self, a: Attempt, h: NodeHandle, r: _Rank, st: procfs.Stat | None, now: float) -> None:
        a.recorded.add(r.rank)
        known = st is not None and st.wait_status is not None
        if not known:
            a.vanished[r.rank] = a.stopping
        self.view.record_exit(ProcessExit(
            job=self.cfg.job, attempt=a.number, node=h.node, rank=r.rank, pid=r.pid, at=now,
            exit_code=st.exit_code if known and st is not None else None,
            signal=st.signal if known and st is not None else None,
            log_tail=tuple(self.rank_log_tail(h, r.local_rank)), expected=a.stopping, vanished=not known))

    def rank_log_tail(self, h: NodeHandle, local_rank: int) -> list[str]:
        """The last lines a local rank wrote to stderr (torchrun's --log-dir layout: .../attempt_0/<lr>/)."""
        files = sorted(h.rank_log_dir.glob(f"*/attempt_*/{local_rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
        return _tail(files[-1], self.cfg.tail_lines) if files else []

    # ---- take over -----------------------------------------------------------------------------------

    def take_over(self, token: str) -> list[int]:
        """After this job's previous healer died: stop every process its last attempt left running, close that
        attempt in the journal, and number the next attempt after it. Returns the pids it killed.

        A healer that comes back never adopts processes it did not start (it cannot wait for them, nor read
        their exit status): it stops them, and the job resumes from its newest good checkpoint. A pid is only
        killed when it still belongs to the attempt (its torchrun run id, `JOB-ATTEMPT`, and the start time the
        journal recorded for it), never a reused one.
        """
        self._check(token)
        entries = [e for e in read_jsonl(journal.path(self.cfg.run_dir)) if isinstance(e.get("attempt"), int)]
        if not entries:
            return []
        last = max(e["attempt"] for e in entries)
        self._first_number = last + 1
        mine = [e for e in entries if e["attempt"] == last]
        if any(e["event"] == "end" for e in mine):
            return []
        targets = journal.targets(mine, f"{self.cfg.job}-{last}")
        for t in targets:
            kill.send(t, signal.SIGKILL)
        kill.wait_gone(targets, timeout_s=30)
        live = sorted(t.pid for t in targets)
        self._journal({"event": "end", "attempt": last, "at": self.clock(), "exit_codes": {}, "stopped": True,
                       "taken_over": True, "killed": live})
        log.warning("took over %s: attempt %d was left running by the previous healer; killed %d process(es)",
                    self.cfg.job, last, len(live))
        return live

    # ---- stop ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """No attempt starts from now on (`megaheal run` is on its way out): a restart ordered before cannot start
        one after the job was stopped."""
        with self._lock:
            self.closed = True

    def stop(self, token: str, grace: timedelta | None = None, hurry: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM every rank, wait up to `grace` for them to save and leave, then SIGKILL what remains (at once
        when `hurry()` turns true: a second Ctrl-C). Every signal is checked first (see healer.launchers.kill)."""
        self._check(token)
        with self._lock:
            a = self.attempt
            if a is None:
                return
            self.view.stopping(self.cfg.job)
            done = a.done
            a.stopping = a.stopping or not done
        if done:
            # Every agent has left; a rank orphaned by a killed agent may not have, and it has no one to
            # answer a SIGTERM to: take it down now.
            leftover = self.rank_targets()
            for t in leftover:
                kill.send(t, signal.SIGKILL)
            kill.wait_gone(leftover, timeout_s=30)
            return
        grace_s = (self.cfg.grace if grace is None else grace).total_seconds()
        targets = self.rank_targets()
        for t in targets:
            kill.send(t, signal.SIGTERM)
        deadline = self.clock() + grace_s
        while self.clock() < deadline and not a.done and not hurry():
            time.sleep(0.1)
            self.poll()
        if not a.done:
            self._kill_attempt(a, targets)

    def _kill_attempt(self, a: Attempt, targets: list[kill.Target]) -> None:
        targets = list({t.pid: t for t in [*targets, *self.rank_targets()]}.values())
        for t in targets:
            kill.send(t, signal.SIGKILL)
        for h in a.handles:
            if h.process.poll() is None:
                # Whatever the agent started that still carries the attempt's run id (a rank's own children too).
                for pid in procfs.descendants(h.process.pid):
                    if (child := kill.identify(pid, a.run_id)) is not None:
                        kill.send(child, signal.SIGKILL)
                # NOTE: the agent is our child: until we reap it, its pid cannot name another process.
                h.process.kill()
        for h in a.handles:
            try:
                h.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.warning("agent of %s did not exit after SIGKILL", h.node, exc_info=True)
        # NOTE: a rank whose agent was killed is an orphan: SIGKILL is delivered at once but the kernel
        # still has to tear the process down. Wait for that, so the next attempt never overlaps this one.
        kill.wait_gone(targets, timeout_s=30)
        self.poll()

    def kill_rank(self, token: str, rank: int, sig: int) -> int:
        """Send `sig` to one rank of the current attempt (fault injection), checked first; returns its pid."""
        self._check(token)
        with self._lock:
            a = self.attempt
            r = next((r for r in (a.ranks.values() if a else []) if r.rank == rank), None)
            target = r.target(a.run_id) if r is not None and a is not None else None
        if target is None or not kill.send(target, sig):
            raise LookupError(f"rank {rank} is not running")
        return target.pid

    def rank_targets(self) -> list[kill.Target]:
        """The current attempt's ranks that are still the processes found (alive, pid not reused)."""
        with self._lock:
            a = self.attempt
            found = [] if a is None else [r.target(a.run_id) for r in a.ranks.values()]
        return [t for t in found if kill.is_current(t)]

    def rank_pids(self) -> list[int]:
        return [t.pid for t in self.rank_targets()]

    def node_of_rank(self, rank: int) -> str:
        """The node `rank` of the current attempt runs on; LookupError when it is not running."""
        with self._lock:
            a = self.attempt
            node = next((r.node for r in (a.ranks.values() if a else []) if r.rank == rank), None)
        if node is None:
            raise LookupError(f"rank {rank} is not running")
        return node

    def ranks_found(self) -> int:
        with self._lock:
            return len(self.attempt.ranks) if self.attempt else 0


def _tail(path: Path, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            return f.read().decode(errors="replace").splitlines()[-n:]
    except FileNotFoundError:
        return []
