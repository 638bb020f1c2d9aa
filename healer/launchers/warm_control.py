"""The coordinator's side of a warm pool: the store its workers take plans from, and the plans.

A job started warm (`Coordinator.Config.warm`) runs its attempts as generations of one pool of workers that outlive
them (train/warm/worker.py, started and watched by each host's agent: healer/agent/warm_host.py). This module holds
the pool's store and decides who holds which rank:

- a formation (the first attempt, and every cold restart): new workers, `r<local rank>` on each host, ranks in
  host order as torchrun numbers them; the generation resumes from the disk (the newest good checkpoint, or the one
  a rollback names);
- a warm restart: the survivors keep their ranks and processes; each rank whose worker is gone (or is to be replaced:
  a hung rank) is taken by an idle worker (a standby) of its own host if there is one, else of any host of the job;
  a host that leaves is replaced in its place by a spare host, whose standbys take its ranks (local rank for local
  rank). The generation resumes from the newest snapshot every rank holds in memory (at or before `at_most_step` for
  a rollback): a replaced rank's from its replica on the next host (train/warm/replicas.py). With no standby for a
  lost rank, or another layout, no warm restart is possible: WarmUnavailable says why, and the restart is cold.
- spare hosts run standbys only (as many as a host has ranks), from the formation on, so a spare takes a lost
  host's ranks without an interpreter to start.

The store listens on `advertise` only (inprocess/store.py), and takes writes from any client that reaches it: every
value in it is sealed with the pool's key (wire/warm_seal.py), which the healer and each host's agent derive from
the run's token and the pool's run id, so only they and the pool's workers can plan a generation. What the workers
run (config, overrides, run directory) is in each host's start order, not in a plan.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from inprocess.store import BoundStore
from wire.orders import WarmStart, Worker
from wire.run_ids import pool_run_id, worker_id
from wire.warm_plan import Plan, checkpoint_name, key, write_plan
from wire.warm_seal import SealedStore, pool_key

log = logging.getLogger(__name__)


class WarmUnavailable(RuntimeError):
    """No warm restart can be made now; the message says why (the restart is then made cold)."""


@dataclass(kw_only=True, slots=True)
class WarmSettings:
    standbys: int = 1
    """Idle workers each host keeps ready to take a rank."""
    advertise: str = "127.0.0.1"
    """The address the workers reach the pool's store at (on a cluster: the healer host's)."""
    hello_timeout_s: float = 120.0
    """How long a formation waits for its new workers to be up (interpreter, torch and the trainer imported)."""
    standby_wait_s: float = 20.0
    """How long a warm restart waits for a standby that is still starting (past it, the restart is cold)."""
    collective_timeout_s: float = 60.0
    """The generations' collective timeout (a rank blocked on a live peer is released by the next plan sooner)."""

    def __post_init__(self) -> None:
        if self.standbys < 0 or self.hello_timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ValueError("standbys must be >= 0, hello_timeout_s and collective_timeout_s > 0")


@dataclass(slots=True)
class Generation:
    number: int
    assign: dict[str, int]
    """worker -> global rank."""
    nodes: tuple[str, ...]
    """The generation's hosts in node-rank order (node rank i holds ranks i*nproc .. i*nproc+nproc-1)."""
    node_of: dict[str, str]
    """worker -> its host."""
    kind: str
    """formation (new workers, from the disk) or warm (survivors and standbys, from memory)."""
    why: str
    replaced: dict[int, str] = field(default_factory=dict)
    """rank -> the standby that took it (warm)."""


class WarmControl:
    def __init__(self, settings: WarmSettings, *, token: str, job: str, nproc_per_node: int) -> None:
        """`token`: the run's (each pool's key is derived from it, as every agent derives it)."""
        self.settings, self.job, self.nproc = settings, job, nproc_per_node
        self._token = token
        self._store: BoundStore | None = None
        self._sealed: SealedStore | None = None
        self.formed_in: int | None = None
        """The attempt that formed the running pool (None: no pool runs)."""
        self.current: Generation | None = None
        self._pinned: tuple[str, ...] = ()
        """The overrides the pool's workers were started with (its formation's), but the batches to skip."""

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:
            # NOTE: on the advertised address only (loopback for the local launcher), not every interface
            self._store = BoundStore(self.settings.advertise, timedelta(seconds=30))
        return self._store.store

    @property
    def endpoint(self) -> str:
        return f"{self.settings.advertise}:{self.store.port}"

    @property
    def sealed(self) -> SealedStore:
        """The store, its values sealed with the running pool's key (WarmUnavailable when none runs)."""
        formed_in, sealed = self.formed_in, self._sealed
        if formed_in is None:
            raise WarmUnavailable("no warm pool runs")
        if sealed is None:
            sealed = self._sealed = SealedStore(self.store, pool_key(self._token, pool_run_id(self.job, formed_in)))
        return sealed

    # ---- what each host is told -----------------------------------------------------------------------

    def form(self, number: int, nodes: tuple[str, ...], why: str) -> Generation:
        """A new pool for attempt `number` on `nodes`: every rank a new worker."""
        assign, node_of = {}, {}
        for node_rank, node in enumerate(nodes):
            for local in range(self.nproc):
                w = worker_id(node, number, f"r{local}")
                assign[w], node_of[w] = node_rank * self.nproc + local, node
        self.formed_in, self._sealed = number, None
        return Generation(number, assign, tuple(nodes), node_of, "formation", why)

    def replace(self, number: int, nodes: tuple[str, ...], workers: dict[str, list[Worker]], why: str,
                discard: frozenset[int] = frozenset()) -> Generation:
        """Attempt `number` warm from the running generation on `nodes`: `workers` is each host's answer to a
        `workers` order (every worker there: id, alive, rank now); `discard`: ranks whose live workers are replaced
        too (they were killed: a hang's). A host of the last generation missing from `nodes` is replaced by the new
        host in its place. WarmUnavailable when it cannot be done."""
        last = self.current
        if last is None or self.formed_in is None:
            raise WarmUnavailable("no warm pool runs")
        if len(nodes) != len(last.nodes):
            raise WarmUnavailable(f"the number of hosts changes ({len(last.nodes)} -> {len(nodes)}): a new layout "
                                  "starts cold")
        joining = {new: old for old, new in zip(last.nodes, nodes) if old != new}
        if set(joining) & set(last.nodes):
            raise WarmUnavailable(f"the hosts are reordered ({', '.join(last.nodes)} -> {', '.join(nodes)})")
        missing = sorted(set(nodes) - set(workers))
        if missing:
            raise WarmUnavailable(f"the agent of {', '.join(missing)} did not answer")
        gone_hosts = set(joining.values())
        alive = {w.id: node for node, ws in workers.items() if node in nodes for w in ws
                 if w.alive and last.assign.get(w.id) not in discard}
        assign = {w: r for w, r in last.assign.items() if w in alive and last.node_of[w] not in gone_hosts}
        node_of = {w: alive[w] for w in assign}
        instead = dict(zip(last.nodes, nodes))
        lost = {r: instead[last.node_of[w]] for w, r in last.assign.items() if w not in assign}
        # Standbys that are up first; then those still importing (one started when the last restart was ready may
        # be seconds from up: waiting for it costs less than a cold start).
        idle = sorted((w for w in alive if w not in last.assign), key=lambda w: not self._up(w))
        replaced: dict[int, str] = {}
        for rank, node in sorted(lost.items()):
            # A standby of the rank's own host first: its local rank, and its share of the host's devices, stay. A
            # joining host's ranks are its own standbys' only (its place is the lost host's, device for device).
            pick = next((w for w in idle if alive[w] == node), None)
            if pick is None and node not in joining:
                pick = idle[0] if idle else None
            if pick is None:
                where = f"{node} (in place of {joining[node]})" if node in joining else node
                raise WarmUnavailable(f"no standby runs on {where} for rank {rank}")
            idle.remove(pick)
            assign[pick], node_of[pick], replaced[rank] = rank, alive[pick], pick
        return Generation(number, assign, tuple(nodes), node_of, "warm", why, replaced)

    def _up(self, worker: str) -> bool:
        """The worker said hello: its imports are done and it reads plans."""
        return self.sealed.has(key("hello", worker))

    def start_orders(self, gen: Generation, spares: tuple[str, ...] = ()) -> dict[str, WarmStart]:
        """Each host's `warm` part of its start order: the generation's hosts their ranks, `spares` standbys only."""
        assert self.formed_in is not None
        out = {}
        for node in gen.nodes:
            mine = {w: r for w, r in gen.assign.items() if gen.node_of[w] == node}
            out[node] = WarmStart(control=self.endpoint, formed_in=self.formed_in, assign=mine,
                                  local_rank={w: r % self.nproc for w, r in mine.items()},
                                  standbys=self.settings.standbys)
        for node in spares:
            # NOTE: a host's worth of standbys: a spare takes all of a lost host's ranks at once.
            out[node] = WarmStart(control=self.endpoint, formed_in=self.formed_in,
                                  standbys=max(self.settings.standbys, self.nproc))
        return out

    # ---- the plan -------------------------------------------------------------------------------------

    def wait_up(self, workers: list[str], timeout_s: float | None = None) -> None:
        """Until every worker said hello; RuntimeError past `timeout_s` (default: hello_timeout_s)."""
        limit = self.settings.hello_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        for w in workers:
            while not self._up(w):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"warm worker {w} not up after {limit:.0f} s")
                time.sleep(0.05)

    def publish(self, gen: Generation, *, overrides: tuple[str, ...], disk_resume: str | None,
                at_most_step: int | None = None) -> None:
        """Generation `gen.number`'s plan: its ranks start (a warm one also ends the generation before it in every
        survivor, which watches for it). `overrides` are the attempt's: the workers run with their formation's (its
        start orders), and a plan changes only the batches to skip; a warm generation whose other overrides differ
        is WarmUnavailable. `disk_resume`: auto, None or a checkpoint (its name goes in the plan)."""
        pinned, skip, tuned = _split(overrides)
        if gen.kind == "warm" and pinned != self._pinned:
            changed = ", ".join(sorted(set(pinned) ^ set(self._pinned)))
            raise WarmUnavailable(f"the attempt's settings changed ({changed}): the workers run with their formation's")
        resume = disk_resume if disk_resume in (None, "auto") else checkpoint_name(disk_resume)
        plan = Plan(generation=gen.number, world=len(gen.assign), assign=gen.assign,
                    local_rank={w: r % self.nproc for w, r in gen.assign.items()}, per_host=self.nproc,
                    resume="memory" if gen.kind == "warm" else "disk", disk_resume=resume, at_most_step=at_most_step,
                    skip_steps=skip, timeout_s=self.settings.collective_timeout_s, **tuned)
        write_plan(self.sealed, plan)
        if gen.kind != "warm":
            self._pinned = pinned
        self.current = gen

    def resumed_from(self, gen: Generation) -> dict[str, str]:
        """worker -> where it resumed from, for those that are ready (train/warm/worker.py writes it)."""
        out: dict[str, str] = {}
        if self.formed_in is None:  # the pool was stopped meanwhile
            return out
        for w in gen.assign:
            if (said := self.sealed.get(key("ready", gen.number, w))) is not None:
                out[w] = said
        return out

    def forget(self) -> None:
        """The pool was stopped on every host (a cold restart follows, with a new one)."""
        self.formed_in, self.current, self._sealed = None, None, None

    def end(self, after: int) -> None:
        """No generation follows `after`: every worker still waiting (the standbys) leaves."""
        if self._store is None or self.formed_in is None:
            return
        write_plan(self.sealed, Plan(generation=after + 1, world=0, assign={}, local_rank={}, stop=True), newest=False)
        self.forget()


TUNED = {"checkpoint.every_steps": "every_steps", "snapshot_every_steps": "snapshot_every_steps"}
"""Overrides the healer tunes (healer/launchers/save_tuning.py) -> the plan's field that carries them."""


def _split(overrides: tuple[str, ...]) -> tuple[tuple[str, ...], list[int], dict[str, int]]:
    """An attempt's overrides but `skip_steps=[a,b]` (healer/launchers/placement.py writes it) and the tuned
    intervals (the last of each wins, as in the trainer's own `--set`), the steps to skip, and the intervals by the
    plan's field."""
    rest, skip, tuned = [], [], {}
    for item in overrides:
        name, _, value = item.partition("=")
        if name == "skip_steps":
            skip = sorted({int(s) for s in value.strip("[] ").split(",") if s.strip()})
        elif name in TUNED:
            tuned[TUNED[name]] = int(value)
        else:
            rest.append(item)
    return tuple(rest), skip, tuned
