"""The host's part of one attempt: its torchrun agent and the ranks under it, as the node agent runs and watches them.

- start: one torchrun agent for this host (`--nnodes N --node-rank K`, c10d rendezvous on the attempt's first
  host, `--max-restarts 0`: restarts are the healer's), in a session of its own;
- poll: finds the ranks under it (their global rank from their environment, their start time for identity),
  samples their kernel state, CPU time (a SIGSTOPped rank is 'T') and the phase each says it is in now
  (wire/phase_now.py: what the healer's hang detector times a save or a restore by), and records every exit:
  read from the zombie while it is one, else as vanished until the torchrun agent's failure report says how the rank
  died. The agent's look comes as soon as a rank ends (`wait_for_exit`: its pidfd), not at its next interval;
- stop: SIGTERM to every rank (the trainer saves a final checkpoint and exits 0), SIGKILL to what is left after the
  grace, then the torchrun agent and whatever it left. Every signal goes only to a process that is still the one
  found (its pid and start time) and carries the attempt's run id, through a pidfd (ground.kill), never
  to a pid the kernel gave to someone else since.

Everything is an argument list; no value from the healer reaches a shell.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ground import kill, procfs
from ground.torchrun_report import parse_failures
from wire import phase_now
from wire.run_ids import run_id
from wire.telemetry import MAX_TAIL_LINES, AttemptReport, RankExit, RankProcess

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Rank:
    rank: int
    local_rank: int
    pid: int
    started: float

    def target(self, run_id: str) -> kill.Target:
        return kill.Target(self.pid, self.started, run_id)


def _process(r: _Rank, state: str, cpu_seconds: float, phase: phase_now.PhaseNow | None) -> RankProcess:
    now = phase if phase is not None and phase.phase else None  # "": between two phases, as good as none
    return RankProcess(rank=r.rank, local_rank=r.local_rank, pid=r.pid, started=r.started, state=state,
                       cpu_seconds=cpu_seconds, phase=now.phase if now else None, phase_step=now.step if now else None,
                       phase_for_s=max(0.0, time.time() - now.since_ns / 1e9) if now else None)


@dataclass(slots=True)
class HostAttempt:
    job: str
    attempt: int
    node_rank: int
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log_dir: Path
    """This host's logs of the attempt: torchrun's own output and its per-rank files."""
    clock: Callable[[], float] = time.time
    phase_dir: Path | None = None
    """Where the attempt's ranks keep their phase-now files (None: they keep none)."""
    rank_offset: int = 0
    """Added to each rank's RANK: a replica group's ranks are numbered over the whole job (wire/orders.ReplicaStart),
    while torchrun numbers them within the group."""
    process: subprocess.Popen[bytes] | AdoptedTorchrun | None = None
    """This host's torchrun agent: our child, or one an agent before us started (`adopt`)."""
    ranks: dict[int, _Rank] = field(default_factory=dict)
    """pid -> rank, as found under the torchrun agent."""
    states: dict[int, tuple[str, float, phase_now.PhaseNow | None]] = field(default_factory=dict)
    """rank -> (kernel state, CPU seconds, phase now) at the last poll, for the ranks still running."""
    exits: dict[int | None, RankExit] = field(default_factory=dict)
    """rank (None: the torchrun agent itself) -> how it ended."""
    stopping: bool = False
    hurry: threading.Event = field(default_factory=threading.Event)
    """Set: a stop in progress gives up its grace and kills now."""
    exit_code: int | None = None
    _log: IO[bytes] | None = None
    _pidfds: dict[int, int] = field(default_factory=dict)
    """pid -> a pidfd of each rank still running (readable once it ends): what `wait_for_exit` waits on."""

    @property
    def run_id(self) -> str:
        """torchrun's rendezvous id of this attempt, which every worker carries (TORCHELASTIC_RUN_ID)."""
        return run_id(self.job, self.attempt)

    @property
    def agent_log(self) -> Path:
        return self.log_dir / "torchrun.log"

    @property
    def rank_log_dir(self) -> Path:
        return self.log_dir / "ranks"

    @property
    def ended(self) -> bool:
        return self.exit_code is not None

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.agent_log, "ab")  # noqa: SIM115 - lives as long as the torchrun agent; closed on its exit
        self.process = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                                        stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def adopt(self, node: str) -> bool:
        """Take on the attempt's torchrun agent on this host, started by an agent that died (it runs in a session
        of its own and outlived it); found by the attempt's run id and, where hosts share a PID namespace (a test
        bed, the local launcher), by the host its agent named in its environment. False when none runs."""
        for pid in procfs.pids():
            t = kill.identify(pid, self.run_id)
            # NOTE: the run id is the attempt's, the same on every host: without the host, the agent of one host
            # took on another's torchrun (the bed's hosts share this machine's PID namespace).
            if t is not None and "torch.distributed.run" in procfs.cmdline(pid) \
                    and procfs.environ(pid).get("MEGAHEAL_NODE", node) == node:
                self.process = AdoptedTorchrun(t, self.agent_log)
                log.warning("adopted attempt %d of %s: torchrun pid %d", self.attempt, self.job, pid)
                return True
        return False

    # ---- watching ------------------------------------------------------------------------------------

    def poll(self) -> None:
        """One look (cheap: /proc reads): new ranks, states, exits."""
        if self.process is None or self.ended:
            return
        now = self.clock()
        for pid in procfs.children(self.process.pid):
            if pid in self.ranks:
                continue
            # NOTE: a worker of this attempt (its run id), and when it started: every signal to it later is checked
            # against both, so a pid reused after it died is never signalled.
            if (t := kill.identify(pid, self.run_id)) is None:
                continue
            env = procfs.environ(pid)
            rank, local = env.get("RANK", ""), env.get("LOCAL_RANK", "0")
            if rank.isdigit():
                self.ranks[pid] = _Rank(int(rank) + self.rank_offset, int(local) if local.isdigit() else 0, pid,
                                        t.started)
                self._watch_exit(pid, t.started)
        for pid, r in self.ranks.items():
            if r.rank in self.exits:
                continue
            st = procfs.stat(pid)
            if st is not None and st.state not in procfs.NOT_ALIVE and st.started == r.started:
                phase = phase_now.read(phase_now.path_for(self.phase_dir, pid)) if self.phase_dir else None
                self.states[r.rank] = (st.state, st.cpu_seconds, phase)
                continue
            self.states.pop(r.rank, None)
            self._unwatch(pid)
            if self.process.poll() is None:
                # NOTE: torchrun reports exit statuses only after stopping its other workers: a rank that died is
                # recorded now, with its status while it is still a zombie, as vanished when torchrun reaped it
                # first (its failure report, when torchrun exits, then says how).
                self._rank_ended(r, st if st is not None and st.started == r.started else None, now)
        code = self.process.poll()
        if code is not None:
            self._agent_ended(code, now)

    def wait_for_exit(self, timeout: float) -> None:
        """Return when a rank found so far ends, or after `timeout` seconds.

        NOTE: torchrun reaps a dead worker at its next look (every 0.2 s here), and a zombie is the only place
        another process can read the exit status from. Looking at the agent's own interval, one crash in two was
        found already reaped: its cause waited for torchrun's failure report, which comes only once torchrun has
        stopped the host's other ranks (up to its 30 s close, for a rank blocked in a collective), and a fresh
        make test named a SIGKILLed rank "vanished". Woken by the pidfd, the look reads the zombie first."""
        fds = list(self._pidfds.values())
        if not fds:
            time.sleep(timeout)
            return
        waiting = select.poll()
        for fd in fds:
            waiting.register(fd, select.POLLIN)
        waiting.poll(timeout * 1000)  # NOTE: a closed fd (POLLNVAL) only wakes it early: the next look sorts it out

    def _watch_exit(self, pid: int, started: float) -> None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return  # gone already, or no pidfds (a kernel before 5.3): the next interval's look finds it
        if procfs.is_same_process(pid, started):
            self._pidfds[pid] = fd
        else:
            os.close(fd)

    def _unwatch(self, pid: int | None = None) -> None:
        """Close the pidfd of `pid` (every one: None)."""
        for p in list(self._pidfds) if pid is None else [pid]:
            fd = self._pidfds.pop(p, None)
            if fd is not None:
                os.close(fd)

    def _rank_ended(self, r: _Rank, st: procfs.Stat | None, now: float) -> None:
        known = st is not None and st.wait_status is not None
        self.exits[r.rank] = RankExit(
            rank=r.rank, pid=r.pid, at=now, exit_code=st.exit_code if known and st is not None else None,
            signal=st.signal if known and st is not None else None, vanished=not known, expected=self.stopping,
            log_tail=self.rank_log_tail(r.local_rank))

    def _agent_ended(self, code: int, now: float) -> None:
        assert self.process is not None
        self.exit_code = code
        self._unwatch()
        if self._log is not None:
            self._log.close()
            self._log = None
        lines = _tail(self.agent_log, 400)
        failures = {f.rank: f for f in parse_failures(lines)}
        for r in self.ranks.values():
            f = failures.get(r.rank)
            old = self.exits.get(r.rank)
            if old is not None and not (old.vanished and f is not None):
                continue
            self.exits[r.rank] = RankExit(
                rank=r.rank, pid=r.pid, at=now, exit_code=f.exit_code if f else 0, signal=f.signal if f else None,
                expected=old.expected if old is not None else self.stopping, log_tail=self.rank_log_tail(r.local_rank))
        self.states.clear()
        if code != 0 and not failures:
            # torchrun itself failed (the rendezvous, say): its own log is the evidence.
            self.exits[None] = RankExit(rank=None, pid=self.process.pid, at=now, exit_code=code if code >= 0 else None,
                                        signal=-code if code < 0 else None, expected=self.stopping,
                                        log_tail=lines[-MAX_TAIL_LINES:])
        log.info("attempt %d of %s: torchrun exited with %d (%d rank failure(s) reported)", self.attempt, self.job,
                 code, len(failures))

    def rank_log_tail(self, local_rank: int, lines: int = MAX_TAIL_LINES) -> list[str]:
        """The last lines a local rank wrote to stderr (torchrun's --log-dir layout: .../attempt_0/<lr>/)."""
        files = sorted(self.rank_log_dir.glob(f"*/attempt_*/{local_rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
        return [line[:2000] for line in _tail(files[-1], lines)] if files else []

    def report(self) -> AttemptReport:
        return AttemptReport(
            job=self.job, attempt=self.attempt, node_rank=self.node_rank, ended=self.ended, exit_code=self.exit_code,
            stopping=self.stopping, exits=list(self.exits.values()),
            ranks=[_process(r, *self.states[r.rank]) for r in self.ranks.values() if r.rank in self.states])

    # ---- acting --------------------------------------------------------------------------------------

    def live_ranks(self) -> list[kill.Target]:
        """The ranks that are still the processes found (same pid, same start) and not dead."""
        return [t for r in self.ranks.values() if kill.is_current(t := r.target(self.run_id))]

    def signal(self, rank: int, sig: int) -> int:
        """Send `sig` to one live rank of this attempt, checked first; its pid. LookupError when it is not running
        here."""
        r = next((r for r in self.ranks.values() if r.rank == rank), None)
        if r is None or not kill.send(r.target(self.run_id), sig):
            raise LookupError(f"rank {rank} is not running on this host in attempt {self.attempt}")
        return r.pid

    def stop(self, grace_s: float) -> None:
        """SIGTERM every rank, wait up to `grace_s` (or until `hurry` is set) for them to save and leave, then
        SIGKILL what remains and the torchrun agent; returns once all of it is gone."""
        self.stopping = True
        if self.process is None or self.ended:
            # torchrun has left; a rank it orphaned may not have, and has no one to answer a SIGTERM to.
            _send(left := self.live_ranks(), signal.SIGKILL)
            kill.wait_gone(left, 30)
            return
        _send(self.live_ranks(), signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not self.ended and not self.hurry.is_set():
            time.sleep(0.05)
            self.poll()
        if not self.ended:
            left = self.live_ranks()
            _send(left, signal.SIGKILL)
            # Whatever torchrun started that still carries the attempt's run id (a rank's own children too).
            for pid in procfs.descendants(self.process.pid):
                if (child := kill.identify(pid, self.run_id)) is not None:
                    kill.send(child, signal.SIGKILL)
                    left.append(child)
            # NOTE: torchrun is our child: until we reap it, its pid cannot name another process.
            self.process.kill()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.warning("torchrun agent %d did not exit after SIGKILL", self.process.pid)
            # NOTE: a rank whose torchrun was killed is an orphan: SIGKILL is delivered at once but the kernel still
            # has to tear it down. Wait for that, so the next attempt never overlaps this one.
            kill.wait_gone(left, 30)
            self.poll()


class AdoptedTorchrun:
    """A torchrun agent this node agent did not start (see HostAttempt.adopt), with the part of Popen's interface
    HostAttempt uses. Not our child: its exit status cannot be read, so it is taken from its own failure report in
    its log (1 when it reports a failed rank, else 0); every signal is checked (its pid, start time, run id)."""

    def __init__(self, target: kill.Target, log_path: Path) -> None:
        self.target, self.pid, self.log_path = target, target.pid, log_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not kill.is_current(self.target):
            self.returncode = 1 if parse_failures(_tail(self.log_path, 400)) else 0
        return self.returncode

    def kill(self) -> None:
        kill.send(self.target, signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        if kill.wait_gone([self.target], timeout):
            raise subprocess.TimeoutExpired(["torchrun", str(self.pid)], timeout)
        code = self.poll()
        assert code is not None
        return code


def _send(targets: list[kill.Target], sig: int) -> None:
    for t in targets:
        kill.send(t, sig)


def _tail(path: Path, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return f.read().decode(errors="replace").splitlines()[-n:]
    except OSError:  # gone, or not a file to read: the tail is evidence, never a reason for the agent to fail
        return []
