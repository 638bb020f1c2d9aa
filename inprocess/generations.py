"""The loop of a process that outlives its generations: it takes plans from its pool's store (wire/warm_plan.py), and
in each plan that gives it a rank it joins the generation's process group, runs what it was given to run, and leaves.
It takes only plans sealed with its pool's key, and seals what it writes there (wire/warm_seal.py).

When a peer dies, the generation's collectives fail (gloo: the connection to the dead peer closes; those blocked on
live peers are released when they tear down their group in turn, or at the generation's collective timeout); and
once the pool plans the next generation, a thread of each member aborts this one (abort.py), so no rank waits in it
for a peer that moved on. The run's exception ends the generation here ("failed: ..."); the process waits for the
next plan, keeping whatever its own state holds. A process without a rank is a standby: it waits, already warm.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from inprocess import waits
from inprocess.abort import GenerationSockets, describe_sockets
from inprocess.leave import leave_process_group
from wire import rank_env
from wire.warm_plan import Plan, key, read_plan
from wire.warm_seal import SealedStore

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

Ready = Callable[[str], None]
"""Called by a generation's run once its state is built: `ready("memory step 12")` tells the pool where it resumed
from (the coordinator waits for every rank's before it trusts the generation)."""
Run = Callable[[Plan, Ready], None]
"""What a generation runs on this rank, once its process group is formed; it returns when the job's work is done
and raises when the generation failed here."""


class GenerationLoop:
    def __init__(self, control: dist.Store, worker: str, watch: dist.Store | None = None,
                 connect: Callable[[], dist.Store] | None = None, keep: frozenset[str] | None = None, *,
                 secret: bytes) -> None:
        """`watch`: a second client of the pool's store, for the thread that watches for the next generation (a
        store client is not shared between threads). `connect`: opens a new client of the pool's store, one per
        generation for its process group (without it the group uses `control`). `keep`: the sockets an abort never
        shuts down (the two clients above; None: those open when each generation starts). `secret`: the pool's key
        (wire/warm_seal.py)."""
        self.control, self.worker, self.watch, self.connect, self.keep = control, worker, watch, connect, keep
        self.sealed = SealedStore(control, secret)
        self.watching = SealedStore(watch, secret) if watch is not None else None
        self.stop_requested = False

    def serve(self, run: Run, from_generation: int | None = None) -> int:
        """Take plans (from generation `from_generation`, or the newest one written) until one says stop, this
        worker's job finished, or it is told to stop between two generations (SIGTERM); returns the exit code."""
        self.sealed.set(key("hello", self.worker), str(os.getpid()))
        if from_generation is not None:
            generation = from_generation
        else:
            newest = self.sealed.get(key("gen"))
            generation = int(newest) if newest is not None else 0
        while True:
            plan = read_plan(self.sealed, generation)
            while plan is None:
                if self.stop_requested:
                    return 0
                time.sleep(PLAN_POLL_S)
                plan = read_plan(self.sealed, generation)
            if plan.stop:
                return 0
            if self.sealed.has(key("plan", generation + 1)):
                # NOTE: planned over already (a rollback while a replacement formed): its peers abort it as they
                # read the next plan, so joining it would only wait for them.
                self.sealed.set(key("end", generation, self.worker), "skipped: a later generation is planned")
                generation += 1
                continue
            if self.worker in plan.assign:
                outcome = self._generation(plan, run)
                self.sealed.set(key("end", generation, self.worker), outcome)
                if outcome == "ok":
                    return 0
            generation += 1

    def _generation(self, plan: Plan, run: Run) -> str:
        rank, world = plan.assign[self.worker], plan.world
        # NOTE: the attempt too: each step record says which attempt it is of (exporters/client.py), and a step this
        # process finishes in an aborted generation must not pass for the next one's (healer/observe/jobview.py).
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(plan.local_rank[self.worker]),
                          **{rank_env.ATTEMPT: str(plan.generation)})
        started = time.monotonic()
        sockets = GenerationSockets(self.keep)
        # NOTE: the generation's rendezvous goes through a store connection of its own, opened after the sockets
        # were counted: an abort shuts it down with the group's, so a rank waiting in the rendezvous for a peer
        # that died or moved on is released at once, not at the timeout (the pool's own connections stay up).
        store = dist.PrefixStore(f"gen/{plan.generation}/", self.connect() if self.connect else self.control)
        over = threading.Event()
        # NOTE: gloo only: NCCL's abort ends its communicators' waits itself (inprocess/waits.py says why gloo's
        # need more).
        interrupt = waits.arm(plan.generation) if plan.backend == "gloo" else None
        watcher = None
        if self.watch is not None:
            watcher = threading.Thread(target=self._abort_when_replaced, args=(plan, sockets, interrupt, over),
                                       daemon=True, name="megaheal-warm-watch")
            watcher.start()

        def ready(source: str) -> None:
            self.sealed.set(key("ready", plan.generation, self.worker),
                            f"{source} in {time.monotonic() - started:.3f} s")

        try:
            dist.init_process_group(plan.backend, store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=plan.timeout_s))
            run(plan, ready)
            return "ok"
        except Exception as exc:  # noqa: BLE001 - a peer died (or this rank failed): leave the group, keep what it holds
            print(f"warm worker {self.worker}: generation {plan.generation} failed here: {type(exc).__name__}: "
                  f"{str(exc)[:300]}", flush=True)
            return f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        finally:
            try:
                # NOTE: left while the watcher still watches, so that a rank stuck in tearing its group down is
                # ended too (LEAVE_WITHIN_S counts from the abort).
                leave_process_group()
            finally:
                over.set()
                if watcher is not None:
                    # NOTE: the watcher ends before the next generation begins: one still running could shut down
                    # that generation's sockets (their descriptors reuse this one's numbers), and it shares `watch`
                    # with the next generation's watcher (a store client is not safe across threads).
                    watcher.join()
                if interrupt is not None:
                    waits.disarm(interrupt)

    def _abort_when_replaced(self, plan: Plan, sockets: GenerationSockets, interrupt: waits.Interrupt | None,
                             over: threading.Event) -> None:
        """The pool planned the next generation while this one runs here (a peer died): abort this one, so that a
        collective waiting on a live peer that already left does not wait for its timeout (its sockets shut down,
        and on gloo its ranks' waits interrupted: inprocess/waits.py)."""
        assert self.watching is not None
        following = key("plan", plan.generation + 1)
        # NOTE: a poll, not store.wait with a timeout: each timed-out wait logs a warning from c10d. A plan not
        # sealed with the pool's key aborts nothing.
        while not over.wait(WATCH_EVERY_S):
            if self.watching.has(following):
                closed = sockets.abort(plan.backend)
                if interrupt is not None:
                    interrupt.set()
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
                for line in describe_sockets(sockets.before):
                    print(f"warm worker {self.worker}: socket {line}", flush=True)
                os._exit(STUCK_EXIT_CODE)


def connect_to(control: str) -> Callable[[], dist.Store]:
    """A maker of clients of the pool's store at HOST:PORT."""
    host, _, port = control.rpartition(":")

    def connect() -> dist.Store:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    return connect
