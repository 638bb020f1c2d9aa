"""The host's warm workers (train/warm/worker.py) and its part of one generation, as the node agent runs them.

A job started warm keeps its rank processes across attempts: every attempt is a generation of one pool of workers
whose plans the healer's coordinator writes to the pool's store (wire/warm_plan.py). On each host the node agent

- starts the workers a start order names (a cold formation: all of them; a warm restart: none, the survivors and a
  standby take the ranks) and keeps `standbys` idle workers ready beside them: interpreter up, torch and the trainer
  imported, waiting for a plan that gives them a rank. New standbys are started only once this host's ranks of the
  generation are ready (started earlier, their imports take the cores the restart needs);
- watches the workers that hold a rank in the current generation as HostAttempt watches torchrun's ranks (state,
  phase, exits: they are its children, so every exit status is read), with the same interface to the agent;
- stops them all when the healer stops the attempt: a stop means a cold restart comes next, and nothing of this
  pool is kept then (SIGTERM: a rank saves and leaves, a standby leaves at once; SIGKILL after the grace).

Workers carry the pool's run id (TORCHELASTIC_RUN_ID, `<job>-warm<attempt that formed the pool>`) and their start
time: every signal is checked against both (ground.kill), like a torchrun rank's. What they run is the forming start
order's (config, overrides, run directory: on their command line), and they take only plans sealed with the pool's
key (wire/warm_seal.py), which the agent derives from the run's token as the healer does and leaves for them in a
private file of the pool's log directory.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from ground import kill, procfs
from healer.agent.host import _process, _Rank, _send, _tail
from wire import phase_now, rank_env
from wire.orders import UserProgram, Worker
from wire.run_ids import pool_run_id, worker_id
from wire.telemetry import AttemptReport, RankExit
from wire.warm_plan import WorkerStart, key
from wire.warm_seal import SealedStore, pool_key, write_key


def _load_torch_distributed() -> None:
    import torch.distributed  # noqa: F401 - loaded ahead of its first use

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Worker:
    id: str
    proc: subprocess.Popen[bytes]
    started: float
    log: Path

    def target(self, run_id: str) -> kill.Target:
        return kill.Target(self.proc.pid, self.started, run_id)


class WarmWorkers:
    """One job's warm workers on this host, formed in one attempt and kept across the generations after it."""

    def __init__(self, *, job: str, node: str, formed_in: int, control: str, python: str, cwd: Path, env: dict[str, str],
                 log_dir: Path, standbys: int, token: str, trainer: WorkerStart | None = None,
                 program: UserProgram | None = None) -> None:
        """`token`: the run's (the pool's key is derived from it). `trainer`: what megaheal's trainer runs in every
        worker (the forming start order's config, overrides and run directory); `program` instead: a user's program
        whose training function megaheal.rank.restartable wraps (its workers run it through
        megaheal/rank/bootstrap.py, told their pool by environment)."""
        if (trainer is None) == (program is None):
            raise ValueError("a warm pool runs either megaheal's trainer or a user's program")
        self.job, self.node, self.formed_in, self.control = job, node, formed_in, control
        self.trainer, self.program = trainer, program
        self.python, self.cwd, self.log_dir, self.standbys = python, cwd, log_dir, standbys
        self.run_id = pool_run_id(job, formed_in)
        self._secret = pool_key(token, self.run_id)
        self.key_file = log_dir / "pool.key"
        self.env = {**env, kill.RUN_ID_ENV: self.run_id}
        self.workers: dict[str, _Worker] = {}
        self._spares_named = 0
        self._store: SealedStore | None = None
        self._lock = threading.Lock()
        # NOTE: torch is loaded now, on a thread of its own, for the store the pool's first attempt will ask: not at
        # the agent's start (~1 s of CPU every agent paid, warm job or not: on a 2-core host that start slowed the
        # training beside it enough that a test's job saw its reduce at twice its baseline), and not in the poll
        # that first asks the store (it holds the agent's lock, and the batches wait on that lock).
        threading.Thread(target=_load_torch_distributed, name="megaheal-warm-torch", daemon=True).start()

    @property
    def store(self) -> SealedStore:
        """A client of the pool's store (for `ready` keys; only values sealed with the pool's key count), connected
        on first use."""
        if self._store is None:
            import torch.distributed as dist  # NOTE: loaded by the time a store is asked for (see __init__)

            host, _, port = self.control.rpartition(":")
            client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
            self._store = SealedStore(client, self._secret)
        return self._store

    def spawn(self, worker: str, from_generation: int) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self.workers:
            write_key(self.key_file, self._secret)  # NOTE: a path is all a worker is told: a file of mode 0600
        path = self.log_dir / f"{worker}.log"
        env = self.env
        if self.trainer is not None:
            argv = [self.python, "-m", "train.warm.worker", "--control", self.control, "--worker", worker,
                    "--key-file", str(self.key_file), *self.trainer.argv(), "--from-generation", str(from_generation)]
        else:
            assert self.program is not None
            p = self.program
            argv = [self.python, "-m", "megaheal.rank.bootstrap", *(["-m"] if p.module else []), p.target, *p.args]
            env = {**env, rank_env.WARM_CONTROL: self.control, rank_env.WARM_WORKER: worker,
                   rank_env.WARM_KEY_FILE: str(self.key_file), rank_env.WARM_FROM: str(from_generation)}
        with open(path, "ab") as out:
            proc = subprocess.Popen(argv, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        started = procfs.start_time(proc.pid)
        # NOTE: our child, not yet reaped: its start time can always be read here.
        self.workers[worker] = _Worker(worker, proc, started if started is not None else 0.0, path)

    def alive(self, worker: str) -> bool:
        w = self.workers.get(worker)
        return w is not None and w.proc.poll() is None

    def idle(self, assigned: set[str]) -> list[str]:
        return [w for w in self.workers if w not in assigned and self.alive(w)]

    def refill(self, assigned: set[str], from_generation: int) -> int:
        """Start standbys until `standbys` idle workers live here; how many were started."""
        started = 0
        with self._lock:
            while len(self.idle(assigned)) < self.standbys:
                self._spares_named += 1
                self.spawn(worker_id(self.node, self.formed_in, f"s{self._spares_named}"), from_generation)
                started += 1
        return started

    def describe(self, assign: dict[str, int]) -> list[Worker]:
        """Every worker here: its id, pid, whether it runs, whether it said hello (is up) and its rank now."""
        out = []
        for w in self.workers.values():
            up = w.proc.poll() is None
            out.append(Worker(id=w.id, pid=w.proc.pid, alive=up, rank=assign.get(w.id), exit_code=w.proc.returncode))
        return out

    def stop(self, grace_s: float, hurry: threading.Event) -> None:
        """SIGTERM every worker (a rank saves and leaves; a waiting one leaves at once), SIGKILL what is left after
        `grace_s` or once `hurry` is set; returns once all are gone."""
        targets = [w.target(self.run_id) for w in self.workers.values() if w.proc.poll() is None]
        _send(targets, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not hurry.is_set() and \
                any(w.proc.poll() is None for w in self.workers.values()):
            time.sleep(0.05)
        left = [w.target(self.run_id) for w in self.workers.values() if w.proc.poll() is None]
        _send(left, signal.SIGKILL)
        for w in self.workers.values():
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.warning("warm worker %s (pid %d) did not exit after SIGKILL", w.id, w.proc.pid)


@dataclass(slots=True)
class WarmHostAttempt:
    """This host's ranks of one generation of a warm pool (HostAttempt's interface, for the node agent)."""

    job: str
    attempt: int
    node_rank: int
    pool: WarmWorkers
    assign: dict[str, int]
    """This host's workers that hold a rank in this generation -> global rank."""
    local_rank: dict[str, int]
    phase_dir: Path | None = None
    clock: Callable[[], float] = time.time
    ranks: dict[int, _Rank] = field(default_factory=dict)
    states: dict[int, tuple[str, float, phase_now.PhaseNow | None]] = field(default_factory=dict)
    exits: dict[int | None, RankExit] = field(default_factory=dict)
    stopping: bool = False
    hurry: threading.Event = field(default_factory=threading.Event)
    exit_code: int | None = None
    ready: bool = False
    """Every rank of this host built its trainer in this generation (then the standbys are refilled)."""
    superseded: bool = False
    """A later generation took this one's place (its ranks live on there)."""

    @property
    def run_id(self) -> str:
        return self.pool.run_id

    @property
    def ended(self) -> bool:
        return self.exit_code is not None

    @property
    def process(self) -> None:
        """No torchrun agent: the workers are the node agent's own children."""
        return None

    def start(self) -> None:
        """Start the assigned workers that do not run yet (a cold formation); a spare host gets its standbys now."""
        for w in self.assign:
            if w not in self.pool.workers:
                self.pool.spawn(w, self.attempt)
        for w in self.assign:
            if not self.pool.alive(w):
                raise RuntimeError(f"warm worker {w} does not run on this host")
            proc = self.pool.workers[w]
            self.ranks[proc.proc.pid] = _Rank(self.assign[w], self.local_rank.get(w, 0), proc.proc.pid,
                                              proc.started)
        if not self.assign:
            self.ready = True
            self.pool.refill(set(), self.attempt)

    def wait_for_exit(self, timeout: float) -> None:
        """The node agent's wait between two looks (HostAttempt.wait_for_exit): the pool's workers are the agent's
        own children, whose exit statuses it reads whenever it looks."""
        time.sleep(timeout)

    def poll(self) -> None:
        if self.ended or self.superseded:
            return
        now = self.clock()
        for w, rank in self.assign.items():
            worker = self.pool.workers[w]
            r = self.ranks[worker.proc.pid]
            if rank in self.exits:
                continue
            code = worker.proc.poll()
            if code is None:
                st = procfs.stat(worker.proc.pid)
                if st is not None and st.state not in procfs.NOT_ALIVE:
                    phase = phase_now.read(phase_now.path_for(self.phase_dir, r.pid)) if self.phase_dir else None
                    self.states[rank] = (st.state, st.cpu_seconds, phase)
                continue
            self.states.pop(rank, None)
            self.exits[rank] = RankExit(rank=rank, pid=r.pid, at=now, exit_code=code if code >= 0 else None,
                                        signal=-code if code < 0 else None, expected=self.stopping,
                                        log_tail=[line[:2000] for line in _tail(worker.log, 50)])
        if len(self.exits) == len(self.assign) and self.assign:
            self.exit_code = 0 if all(e.exit_code == 0 for e in self.exits.values()) else 1
            self.states.clear()
        if not self.ready and self.assign and not self.exits:
            try:
                self.ready = all(self.pool.store.has(key("ready", self.attempt, w)) for w in self.assign)
            except (RuntimeError, OSError) as exc:  # the pool's store gone (its healer died): nothing is refilled
                log.warning("warm pool of %s: its store does not answer: %s", self.job, exc)
                return
            if self.ready and (n := self.pool.refill(set(self.assign), self.attempt + 1)):
                log.info("attempt %d of %s ready here: %d standby(s) started", self.attempt, self.job, n)

    def rank_log_tail(self, local_rank: int, lines: int = 50) -> list[str]:
        w = next((w for w, lr in self.local_rank.items() if lr == local_rank and w in self.assign), None)
        return _tail(self.pool.workers[w].log, lines) if w is not None else []

    def report(self) -> AttemptReport:
        return AttemptReport(
            job=self.job, attempt=self.attempt, node_rank=self.node_rank, ended=self.ended, exit_code=self.exit_code,
            stopping=self.stopping, exits=list(self.exits.values()),
            ranks=[_process(r, *self.states[r.rank]) for r in self.ranks.values() if r.rank in self.states])

    def live_ranks(self) -> list[kill.Target]:
        return [t for r in self.ranks.values() if kill.is_current(t := r.target(self.run_id))]

    def signal(self, rank: int, sig: int) -> int:
        r = next((r for r in self.ranks.values() if r.rank == rank), None)
        if r is None or not kill.send(r.target(self.run_id), sig):
            raise LookupError(f"rank {rank} is not running on this host in attempt {self.attempt}")
        return r.pid

    def stop(self, grace_s: float) -> None:
        """The whole pool on this host: what follows a stop is a cold start with new workers."""
        self.stopping = True
        self.pool.stop(grace_s, self.hurry)
        self.poll()
        if not self.ended:
            self.exit_code = 1 if self.assign else 0
