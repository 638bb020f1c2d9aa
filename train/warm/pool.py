"""A pool of warm workers on one host that runs a job and restarts it warm when a rank dies.

The pool starts `world` workers and `standbys` more (train/warm/worker.py), holds the store they take plans from,
and watches them. When a rank's worker dies it writes the next generation's plan at once: the survivors keep their
ranks (and their processes), a standby takes the dead rank, and the generation resumes from the newest state every
rank holds in memory. A new standby is started to take the place of the one used. What it cannot trust it restarts
cold: a rank that dies before its generation is ready (a second crash during a warm restart) makes the next
generation start from the disk checkpoint with all-new workers.

This is the pool of one host; across hosts the node agents hold one each and the healer plans the generations
(healer/launchers/warm_control.py). It is usable alone too: `python -m train.warm.pool --config ... --nproc 4`.

What the workers run (config, overrides, run directory) is on their command line; the plans only say who holds which
rank and where to resume from, sealed with a random key of this pool that its workers read from a private file
(wire/warm_seal.py): a client of the store without it cannot plan a generation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from inprocess.store import BoundStore
from wire.run_paths import RunPaths
from wire.warm_plan import Plan, WorkerStart, key, write_plan
from wire.warm_seal import SealedStore, new_key, write_key

REPO = Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class Restart:
    """One restart the pool made, and how long its parts took (pool clock, seconds)."""

    generation: int
    kind: str
    """warm, cold or rollback."""
    why: str
    died_at: float
    planned_at: float
    ready_at: float | None = None
    sources: dict[str, str] = field(default_factory=dict)
    """worker -> where it resumed from, as it reported."""

    def to_dict(self) -> dict[str, object]:
        return {"generation": self.generation, "kind": self.kind, "why": self.why,
                "detect_to_plan_s": round(self.planned_at - self.died_at, 4),
                "plan_to_ready_s": None if self.ready_at is None else round(self.ready_at - self.planned_at, 4),
                "sources": self.sources}


class WarmPool:
    def __init__(self, config: str, run_dir: Path, world: int, overrides: list[str] | None = None,
                 standbys: int = 1, per_host: int = 0, env: dict[str, str] | None = None,
                 python: str = sys.executable, timeout_s: float = 60.0, max_restarts: int = 3) -> None:
        self.config, self.run_dir, self.world = config, Path(run_dir), world
        self.overrides = list(overrides or [])
        self.standbys, self.per_host, self.python = standbys, per_host, python
        self.timeout_s, self.max_restarts = timeout_s, max_restarts
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        self.store: dist.TCPStore | None = None
        """The pool's store (values in it are sealed: read them through `sealed`)."""
        self.sealed: SealedStore | None = None
        self._bound: BoundStore | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.generation = -1
        self.assign: dict[str, int] = {}
        self.restarts: list[Restart] = []
        self._next_id = 0
        self._refills = 0
        """Standbys to start once the running restart is ready (started earlier, their imports would take the cores
        the restart needs: the standby that took a rank was ready in 1.89 s instead of ~0.5 s, once measured)."""
        self.log_dir = RunPaths(self.run_dir).warm
        self.key_file = self.log_dir / "pool.key"

    # ---- workers -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """The store, then every worker (ranks and standbys), then generation 0 once all are up."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        secret = new_key()
        write_key(self.key_file, secret)
        self._bound = BoundStore("127.0.0.1", timedelta(seconds=30))  # NOTE: the loopback only (inprocess/store.py)
        self.store = self._bound.store
        self.sealed = SealedStore(self.store, secret)
        workers = [self._spawn() for _ in range(self.world + self.standbys)]
        self._wait_hello(workers)
        self._plan(workers[:self.world], resume="memory")

    def _spawn(self) -> str:
        assert self.store is not None
        worker = f"w{self._next_id}"
        self._next_id += 1
        log = open(self.log_dir / f"{worker}.log", "ab")  # noqa: SIM115 (the child holds it)
        start = WorkerStart(self.config, str(self.run_dir), tuple(self.overrides))
        self.procs[worker] = subprocess.Popen(
            [self.python, "-m", "train.warm.worker", "--control", f"127.0.0.1:{self.store.port}", "--worker", worker,
             "--key-file", str(self.key_file), *start.argv()],
            cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return worker

    def up(self, worker: str) -> bool:
        """The worker said hello: its imports are done and it reads plans."""
        assert self.sealed is not None
        return self.sealed.has(key("hello", worker))

    def _wait_hello(self, workers: list[str], timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for w in workers:
            while not self.up(w):
                if self.procs[w].poll() is not None:
                    raise RuntimeError(f"warm worker {w} exited with {self.procs[w].returncode} before it was up "
                                       f"(log: {self.log_dir / f'{w}.log'})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"warm worker {w} not up after {timeout_s:.0f} s")
                time.sleep(0.02)

    def standby_workers(self) -> list[str]:
        return [w for w, p in self.procs.items() if w not in self.assign and p.poll() is None]

    def _plan(self, ranks: list[str], resume: str, at_most_step: int | None = None) -> None:
        """Generation g+1: `ranks[i]` gets rank i."""
        assert self.sealed is not None
        self.generation += 1
        self.assign = {w: r for r, w in enumerate(ranks)}
        per_host = self.per_host or self.world
        write_plan(self.sealed, Plan(generation=self.generation, world=self.world, assign=self.assign,
                                     local_rank={w: r % per_host for w, r in self.assign.items()},
                                     per_host=self.per_host, resume=resume, at_most_step=at_most_step,
                                     timeout_s=self.timeout_s))

    # ---- watching --------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        """Every rank of the current generation built its trainer and resumed."""
        assert self.sealed is not None
        return all(self.sealed.has(key("ready", self.generation, w)) for w in self.assign)

    def poll(self) -> str | None:
        """One look: None while the job runs; 'finished' or 'failed: ...' when it is over."""
        now = time.monotonic()
        last = self.restarts[-1] if self.restarts else None
        if last is not None and last.ready_at is None and self.ready():
            last.ready_at = now
            assert self.sealed is not None
            last.sources = {w: self.sealed.get(key("ready", self.generation, w)) or "" for w in self.assign}
            for _ in range(self._refills):
                self._spawn()  # the pool's standbys again (not waited for: they are not needed now)
            self._refills = 0
        dead = {w: p.returncode for w, p in self.procs.items() if w in self.assign and p.poll() is not None}
        if dead and all(code == 0 for code in dead.values()) and len(dead) == len(self.assign):
            return "finished"
        if not any(code != 0 for code in dead.values()) and not (self._forming() and dead):
            return None
        # NOTE: a rank that finished (exit 0) is gone as surely as one that crashed once a peer failed or before the
        # generation it was planned into formed: a rank lost after the job's last step leaves its peers to finish
        # and exit while the replacement waits for them in the rendezvous (the pool once waited out its 540 s so).
        if len(self.restarts) >= self.max_restarts:
            return f"failed: {', '.join(f'{w} exited {c}' for w, c in dead.items())} with the restart budget spent"
        self._restart(dead, now)
        return None

    def _forming(self) -> bool:
        """Whether the newest restart's generation is not ready yet."""
        return bool(self.restarts) and self.restarts[-1].ready_at is None

    def _restart(self, gone: dict[str, int], died_at: float) -> None:
        """A new generation without the workers `gone` (worker -> exit code)."""
        why = ", ".join(f"rank {self.assign[w]} ({w}) " + ("finished" if c == 0 else f"exited {c}")
                        for w, c in gone.items())
        during = self._forming()
        survivors = [w for w in self.assign if w not in gone]
        spare = self.standby_workers()
        if during or len(spare) < len(gone):
            # A rank gone while the last restart was not ready, or no standby for each one gone: nothing held in memory
            # is trusted: all-new workers, from the disk checkpoint.
            for w in survivors + spare:
                self.procs[w].kill()
            for w in survivors + spare:
                self.procs[w].wait()
            self.assign = {}
            fresh = [self._spawn() for _ in range(self.world + self.standbys)]
            self._wait_hello(fresh)
            self._plan(fresh[:self.world], resume="disk")
            kind = "cold"
        else:
            ranks = [""] * self.world
            for w in survivors:
                ranks[self.assign[w]] = w
            for w, taken in zip(gone, spare):
                ranks[self.assign[w]] = taken
            self._plan(ranks, resume="memory")
            self._refills += len(gone)
            kind = "warm"
        self.restarts.append(Restart(self.generation, kind, why, died_at, time.monotonic()))

    def rollback(self, at_most_step: int, why: str) -> None:
        """Every rank back to a state it holds in memory at or before `at_most_step` (a bad batch, not a bad
        process): the next generation keeps every worker and its rank; the running one (or the one still forming)
        is aborted in each of them as they read the plan."""
        self._plan(sorted(self.assign, key=self.assign.__getitem__), resume="memory", at_most_step=at_most_step)
        now = time.monotonic()
        self.restarts.append(Restart(self.generation, "rollback", why, now, now))

    def run(self, timeout: timedelta, poll_s: float = 0.02, on_poll: object = None) -> str:
        deadline = time.monotonic() + timeout.total_seconds()
        while time.monotonic() < deadline:
            if callable(on_poll):
                on_poll(self)
            outcome = self.poll()
            if outcome is not None:
                return outcome
            time.sleep(poll_s)
        return "timeout"

    def kill_rank(self, rank: int, sig: int) -> int:
        """Signal the worker that holds `rank` now; returns its pid."""
        worker = next(w for w, r in self.assign.items() if r == rank)
        os.kill(self.procs[worker].pid, sig)
        return self.procs[worker].pid

    def pids(self) -> dict[int, int]:
        """rank -> pid of the current generation."""
        return {r: self.procs[w].pid for w, r in self.assign.items()}

    def close(self) -> None:
        """Stop every worker (standbys are told to; anything left is killed)."""
        if self.sealed is not None:
            write_plan(self.sealed, Plan(generation=self.generation + 1, world=self.world, assign={}, local_rank={},
                                         stop=True), newest=False)
        for p in self.procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def report(self) -> dict[str, object]:
        return {"generations": self.generation + 1, "restarts": [r.to_dict() for r in self.restarts]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.warm.pool", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--nproc", type=int, required=True, help="ranks (the job's world size)")
    parser.add_argument("--standbys", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="give up after this long")
    args = parser.parse_args(argv)
    pool = WarmPool(args.config, Path(args.run_dir), args.nproc, args.overrides, standbys=args.standbys)
    pool.start()
    try:
        outcome = pool.run(timedelta(seconds=args.timeout_s))
    finally:
        pool.close()
    print(json.dumps({"outcome": outcome, **pool.report()}, indent=2))
    return 0 if outcome == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
