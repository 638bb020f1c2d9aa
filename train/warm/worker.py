"""A training process that outlives a failed attempt: it trains in one generation after another.

    python -m train.warm.worker --control HOST:PORT --worker ID [--from-generation G]

It starts once (interpreter, torch, the trainer imported) and then takes plans from its pool's store
(wire/warm_plan.py). In a plan that gives it a rank it joins the generation's process group, resumes (from its own
snapshot in memory, from a peer's replica when it replaces a rank that died, or from the disk checkpoint when no
state is held by all) and trains. When a peer dies its collectives fail (gloo: the connection to the dead peer
closes; those blocked on live peers are released when they tear down their group in turn, or at the generation's
collective timeout): it abandons the step, leaves the group, reports, and waits for the next plan, keeping its
snapshots. A worker without a rank is a standby: it waits, already warm, for a plan that gives it one.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import yaml

from train.config import load_config
from train.entry import leave_process_group
from train.trainer import Trainer
from train.warm.abort import GenerationSockets, open_sockets
from train.warm.replicas import Replicas, gather_resume_state, replica_stride
from wire.warm_plan import Plan, key

WATCH_EVERY_S = 0.05
"""How often a rank in a generation looks for the next one (a store round trip on the host's network)."""
LEAVE_WITHIN_S = 20.0
"""How long a rank may take to leave a generation once it was aborted (a step's collectives failing, the trainer
closed: ~1 s here under load) before it is deemed stuck in it and exits."""
STUCK_EXIT_CODE = 75
"""The exit code of a worker that could not leave an aborted generation."""
PLAN_POLL_S = 0.05
"""How often a worker without a generation looks for its next plan. NOTE: a poll, not a blocking store.wait: a
signal's Python handler runs only between bytecodes, and a SIGTERM must end a waiting worker at once."""


class Worker:
    def __init__(self, control: dist.Store, worker: str, watch: dist.Store | None = None,
                 connect: Callable[[], dist.Store] | None = None, keep: frozenset[str] | None = None) -> None:
        """`watch`: a second client of the pool's store, for the thread that watches for the next generation (a
        store client is not shared between threads). `connect`: opens a new client of the pool's store, one per
        generation for its process group (without it the group uses `control`). `keep`: the sockets an abort never
        shuts down (the two clients above; None: those open when each generation starts)."""
        self.control, self.worker, self.watch, self.connect, self.keep = control, worker, watch, connect, keep
        self.replicas: Replicas | None = None
        self.trainer: Trainer | None = None
        self.stop_requested = False

    def serve(self, from_generation: int | None = None) -> int:
        """Take plans (from generation `from_generation`, or the newest one written) until one says stop, this
        worker's job finished, or it is told to stop between two generations (SIGTERM); returns the exit code."""
        self.control.set(key("hello", self.worker), str(os.getpid()))
        if from_generation is not None:
            generation = from_generation
        else:
            generation = int(self.control.get(key("gen"))) if self.control.check([key("gen")]) else 0
        while True:
            while not self.control.check([key("plan", generation)]):
                if self.stop_requested:
                    return 0
                time.sleep(PLAN_POLL_S)
            plan = Plan.from_json(self.control.get(key("plan", generation)))
            if plan.stop:
                return 0
            if self.control.check([key("plan", generation + 1)]):
                # NOTE: planned over already (a rollback while a replacement formed): its peers abort it as they
                # read the next plan, so joining it would only wait for them.
                self.control.set(key("end", generation, self.worker), "skipped: a later generation is planned")
                generation += 1
                continue
            if self.worker in plan.assign:
                outcome = self._train(plan)
                self.control.set(key("end", generation, self.worker), outcome)
                if outcome == "ok":
                    return 0
            generation += 1

    def _train(self, plan: Plan) -> str:
        rank, world = plan.assign[self.worker], plan.world
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(plan.local_rank[self.worker]))
        # NOTE: the disk is where a generation without a common snapshot (or the first) starts from.
        disk = [f"checkpoint.resume={plan.disk_resume}"] if plan.disk_resume else []
        cfg = load_config(plan.config, [*plan.overrides, *disk])
        started = time.monotonic()
        sockets = GenerationSockets(self.keep)
        # NOTE: the generation's rendezvous goes through a store connection of its own, opened after the sockets
        # were counted: an abort shuts it down with the group's, so a rank waiting in the rendezvous for a peer
        # that died or moved on is released at once, not at the timeout (the pool's own connections stay up).
        store = dist.PrefixStore(f"gen/{plan.generation}/", self.connect() if self.connect else self.control)
        over = threading.Event()
        watcher = None
        if self.watch is not None:
            watcher = threading.Thread(target=self._abort_when_replaced, args=(plan, sockets, over), daemon=True,
                                       name="megaheal-warm-watch")
            watcher.start()
        try:
            dist.init_process_group(plan.backend, store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=plan.timeout_s))
            stride = replica_stride(world, plan.per_host or world)
            if self.replicas is None or (self.replicas.rank, self.replicas.world) != (rank, world):
                self.replicas = Replicas(rank, world, stride)  # a fresh rank (or a new layout): nothing it holds counts
            # NOTE: a group of its own for the replicas under NCCL (host tensors); on gloo the training group serves.
            self.replicas.group = dist.new_group(backend="gloo") if plan.backend != "gloo" else None
            snapshot = gather_resume_state(self.replicas, plan.at_most_step) if plan.resume == "memory" else None
            source = f"memory step {snapshot.step}" if snapshot is not None else "disk"
            if rank == 0:
                Path(plan.run_dir).mkdir(parents=True, exist_ok=True)
                (Path(plan.run_dir) / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            self.trainer = Trainer(cfg, Path(plan.run_dir), snapshot=snapshot, replicas=self.replicas)
            if rank == 0 and plan.at_most_step is not None and snapshot is not None:
                # NOTE: a rollback in memory throws away what was trained after the snapshot, as one from a checkpoint
                # does: so are the disk's checkpoints of it. A fresh make test's warm rollback past a NaN had a rank
                # that could not leave the aborted generation; the cold restart after it resumed from the poisoned
                # step 16 on disk, and rolled back four times more until the restart budget was spent.
                self.trainer.checkpointer.abandon_after(snapshot.step, f"a state held in memory (warm rollback, "
                                                                       f"generation {plan.generation})")
            self.control.set(key("ready", plan.generation, self.worker),
                             f"{source} in {time.monotonic() - started:.3f} s")
            if self.stop_requested:
                self.trainer.request_stop()
            self.trainer.run()
            return "ok"
        except Exception as exc:  # a peer died (or this rank failed): leave the group, keep what is held
            return f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        finally:
            over.set()
            if watcher is not None:
                # NOTE: the watcher ends before the group is left: one still running could shut down the sockets of
                # the next generation (their descriptors reuse this one's numbers), and it shares `watch` with the
                # next generation's watcher (a store client is not safe across threads).
                watcher.join()
            # NOTE: the group's sockets close only once nothing holds it (the trainer's modules, pipeline stages and
            # flight recorder do): a peer blocked in a collective with this rank, not with the dead one, is
            # released by that close (gloo's abort does not wake it), so drop the trainer before the group.
            self.trainer = None
            leave_process_group()

    def _abort_when_replaced(self, plan: Plan, sockets: GenerationSockets, over: threading.Event) -> None:
        """The pool planned the next generation while this one runs here (a peer died): abort this one, so that a
        collective waiting on a live peer that already left does not wait for its timeout."""
        assert self.watch is not None
        following = key("plan", plan.generation + 1)
        # NOTE: a poll, not store.wait with a timeout: each timed-out wait logs a warning from c10d.
        while not over.wait(WATCH_EVERY_S):
            if self.watch.check([following]):
                closed = sockets.abort(plan.backend)
                print(f"warm worker {self.worker}: generation {plan.generation + 1} planned; generation "
                      f"{plan.generation} aborted here ({closed} socket(s) shut down)", flush=True)
                break
        else:
            return
        # NOTE: and again until the generation is left: a rank still forming its group opens new sockets after the
        # first abort (gloo retries a connection to a peer that already left with a new socket each time), which
        # would hold it in the rendezvous until its timeout. NCCL's abort ends its communicators once and for all.
        deadline = time.monotonic() + LEAVE_WITHIN_S
        while not over.wait(WATCH_EVERY_S):
            if plan.backend == "gloo":
                sockets.abort(plan.backend)
            if time.monotonic() > deadline:
                # A rank that cannot leave a generation that is over would hold every peer in the next one's
                # rendezvous: it ends instead, with its stacks, and is replaced as a crash is.
                print(f"warm worker {self.worker}: generation {plan.generation} not left {LEAVE_WITHIN_S:.0f} s "
                      f"after it was aborted; exiting (code {STUCK_EXIT_CODE}) with the stacks below", flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(STUCK_EXIT_CODE)

    def request_stop(self) -> None:
        """SIGTERM: a final checkpoint and a clean exit, as under torchrun (async-signal safe: flags only)."""
        self.stop_requested = True
        if self.trainer is not None:
            self.trainer.request_stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.warm.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--control", required=True, metavar="HOST:PORT", help="the pool's store")
    parser.add_argument("--worker", required=True, help="this worker's id in the pool")
    parser.add_argument("--from-generation", type=int, default=None,
                        help="the first generation whose plan it reads (default: the newest written)")
    args = parser.parse_args(argv)
    faulthandler.enable()  # as train/__main__.py: a fatal signal prints the Python stacks first
    host, _, port = args.control.rpartition(":")

    def connect() -> dist.Store:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))

    control, watch = connect(), connect()
    worker = Worker(control, args.worker, watch=watch, connect=connect, keep=open_sockets())
    signal.signal(signal.SIGTERM, lambda signum, frame: worker.request_stop())
    return worker.serve(args.from_generation)


if __name__ == "__main__":
    code = main()
    # NOTE: out without the interpreter's shutdown, which joins every thread pool's threads: an async save that was
    # in flight when its generation was aborted can stay blocked in that generation's collective for good, and held
    # a worker whose job had finished (its own final save committed) at exit for the pool's whole timeout.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
