"""The collective bandwidth job: its own short torch.distributed run, one process per rank.

The step worker imports torch once and forks the ranks (CPU): on a small machine this saves each
rank the 1-3 s `import torch` costs, which is most of the job's time. With CUDA the ranks are
spawned instead (CUDA must not be initialised before a fork). The parent holds the rendezvous
TCPStore on an ephemeral port, so there is no port to race for, and collects each rank's timings
over a pipe. Every rank applies the same deterministic schedule, so no coordination is needed
beyond the collectives themselves.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import statistics
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from runbooks.busbw import ELEMENT_BYTES
from runbooks.checks.pairwise import round_robin

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class SendDelay:
    """Fault injection: `rank` sleeps `delay` before every send (to `peer` only, when set)."""

    rank: int
    delay: timedelta
    peer: int | None = None


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """What the ranks run; built by the check from its validated Config."""

    world_size: int
    ranks_per_node: int
    device: str  # "cpu" (gloo) or "cuda" (nccl)
    collectives: list[str]
    sizes: list[int]
    warmup: int
    iters: int
    budget_s: float
    pairwise: bool
    pair_size: int
    pair_repeats: int
    timeout: timedelta
    fault: SendDelay | None = None
    leaders: list[int] = field(default_factory=list)  # first rank of each node, filled in by run_job


class JobError(RuntimeError):
    """The job did not produce a result from every rank; the message names the ranks and why."""


def run_job(spec: JobSpec) -> list[dict[str, Any]]:
    """Run the job to completion; each rank's timings, in rank order."""
    import torch.distributed as dist  # noqa: F401  (imported before forking so the ranks share it)

    spec.leaders = list(range(0, spec.world_size, spec.ranks_per_node))
    ctx = mp.get_context("spawn" if spec.device == "cuda" else "fork")
    pipes = [ctx.Pipe(duplex=True) for _ in range(spec.world_size)]
    procs = [ctx.Process(target=_rank_main, args=(r, spec, pipes[r][1]), daemon=True) for r in range(spec.world_size)]
    for p in procs:
        p.start()
    try:
        store = dist.TCPStore("127.0.0.1", 0, None, True, spec.timeout, wait_for_workers=False)
        for parent_end, _ in pipes:
            parent_end.send(store.port)
        return _collect(procs, [p for p, _ in pipes], spec.timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def _collect(procs: list[Any], conns: list[Any], timeout: timedelta) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout.total_seconds()
    results: dict[int, dict[str, Any]] = {}
    while len(results) < len(conns):
        for rank, conn in enumerate(conns):
            if rank in results:
                continue
            if conn.poll(0.05):
                results[rank] = conn.recv()
            elif not procs[rank].is_alive() and not conn.poll():
                results[rank] = {"error": f"rank {rank} exited with code {procs[rank].exitcode} without a result"}
        if any("error" in r for r in results.values()):
            break  # the others would only wait for the failed rank until their timeout
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(conns))) - set(results))
            raise JobError(f"ranks {missing} gave no result within {timeout.total_seconds():g}s")
    errors = {r: res["error"] for r, res in results.items() if "error" in res}
    if errors:
        first = min(errors)
        raise JobError(f"rank(s) {sorted(errors)} failed; rank {first}: {errors[first].strip().splitlines()[-1]}")
    return [results[r] for r in range(len(conns))]


# ---------------------------------------------------------------------------- inside each rank


def _rank_main(rank: int, spec: JobSpec, conn: Any) -> None:
    try:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", conn.recv(), None, False, spec.timeout)
        conn.send(rank_body(rank, spec, store, local_rank=rank))
    except Exception:  # noqa: BLE001 -- a probe fails closed: the parent must learn why, whatever it was
        log.error("collective job rank %d failed", rank, exc_info=True)
        conn.send({"error": traceback.format_exc()})
    finally:
        conn.close()


def rank_body(
    rank: int, spec: JobSpec, store: Any, local_rank: int, gather: bool = False, extra: dict[str, Any] | None = None
) -> Any:
    """One rank's timings (plus `extra`). With `gather`, rank 0 returns every rank's, in rank order, and
    the others None: a launcher that cannot hand each rank a pipe (srun across hosts) reads rank 0 only."""
    import torch
    import torch.distributed as dist

    if spec.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=spec.world_size, timeout=spec.timeout, device_id=device
        )
    else:
        # One thread per rank: the ranks share the machine's cores (oversubscription slows everyone).
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=spec.world_size, timeout=spec.timeout)
    try:
        ops = _Ops(rank, spec, device)
        out: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "sweep": {}, "iters": {}, "pairs": {},
                               **(extra or {})}
        for collective in spec.collectives:
            timed = {str(size): ops.time(collective, size) for size in spec.sizes}
            out["sweep"][collective] = {size: seconds for size, (seconds, _) in timed.items()}
            out["iters"][collective] = {size: iters for size, (_, iters) in timed.items()}
        if spec.pairwise:
            out["pairs"] = _pairwise(rank, spec, ops)
        if not gather:
            return out
        everyone: list[Any] | None = [None] * spec.world_size if rank == 0 else None
        dist.gather_object(out, everyone, dst=0)
        return everyone
    finally:
        dist.destroy_process_group()


def iterations_in_budget(op_s: float, warmup: int, iters: int, budget_s: float) -> tuple[int, int]:
    """(warm-ups, timed iterations) for operations of `op_s` seconds: as asked where they fit `budget_s`; else no
    more warm-up (an operation that slow is dominated by the transfer, not by first-use costs) and as many timed
    iterations as fit, one at least."""
    if op_s * (warmup + iters) <= budget_s:
        return warmup, iters
    return 0, max(1, min(iters, int(budget_s / op_s)))


class _Ops:
    """The timed collectives of one rank, on float32 tensors of a given total size in bytes."""

    def __init__(self, rank: int, spec: JobSpec, device: Any) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.spec, self.device = rank, spec, device

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def time(self, collective: str, size: int) -> tuple[float, int]:
        """Mean seconds per operation on this rank after warm-up, as nccl-tests reports it, and the operations
        timed: fewer than the spec's where they would not fit its budget (iterations_in_budget)."""
        op = self._make(collective, size, None)
        warmup, iters = self.spec.warmup, self.spec.iters
        if warmup:
            self.dist.barrier()
            start = time.perf_counter()
            op()
            self._sync()
            warmup, iters = self._fitted(time.perf_counter() - start)
        for _ in range(warmup):
            op()
        self._sync()
        self.dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            op()
        self._sync()
        return (time.perf_counter() - start) / iters, iters

    def _fitted(self, first_s: float) -> tuple[int, int]:
        """The warm-ups left and the timed iterations, from the first warm-up's time on the slowest rank: every
        rank must run as many operations, so they agree on it first."""
        torch = self.torch
        slowest = torch.tensor([first_s], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(slowest, op=self.dist.ReduceOp.MAX)
        return iterations_in_budget(float(slowest.item()), self.spec.warmup - 1, self.spec.iters, self.spec.budget_s)

    def time_pair(self, size: int, peer: int) -> float:
        """Median seconds of one exchange with `peer`: one preempted iteration must not blame a pair."""
        op = self._make("sendrecv", size, peer)
        for _ in range(self.spec.warmup):
            op()
        samples = []
        for _ in range(self.spec.iters):
            self._sync()
            start = time.perf_counter()
            op()
            self._sync()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def _make(self, collective: str, size: int, peer: int | None) -> Any:
        torch, dist, n = self.torch, self.dist, self.spec.world_size
        count = size // ELEMENT_BYTES
        full = torch.ones(count, dtype=torch.float32, device=self.device)
        part = torch.empty(count // n, dtype=torch.float32, device=self.device)
        if collective == "all_reduce":
            return lambda: dist.all_reduce(full)
        if collective == "all_gather":
            return lambda: dist.all_gather_single(full, part)
        if collective == "reduce_scatter":
            return lambda: dist.reduce_scatter_single(part, full)
        if collective == "all_to_all":
            out = torch.empty_like(full)
            return lambda: dist.all_to_all_single(out, full)
        if collective == "sendrecv":
            dst = peer if peer is not None else (self.rank + 1) % n
            src = peer if peer is not None else (self.rank - 1) % n
            recv = torch.empty_like(full)
            return lambda: self._sendrecv(full, dst, recv, src)
        raise ValueError(f"unknown collective {collective!r}")

    def _sendrecv(self, send: Any, dst: int, recv: Any, src: int) -> None:
        fault = self.spec.fault
        if fault is not None and fault.rank == self.rank and fault.peer in (None, dst):
            time.sleep(fault.delay.total_seconds())  # the injected slow send path
        ops = [self.dist.P2POp(self.dist.isend, send, dst), self.dist.P2POp(self.dist.irecv, recv, src)]
        for work in self.dist.batch_isend_irecv(ops):
            work.wait()


def _pairwise(rank: int, spec: JobSpec, ops: _Ops) -> dict[str, float]:
    """Each round, disjoint pairs of node leaders exchange `pair_size` bytes both ways at once.

    The whole schedule is repeated and each pair keeps its best time: interference from other
    work on the machine comes and goes, a slow node or link is slow every time.

    NOTE: when every leader runs on one machine (local ranks, or the namespace hosts of the test
    bed), the pairs of a round share its CPUs and time each other's scheduling instead of the
    network, so there pairs run one at a time. Measured on 2 cores under a load of ~6 from other
    work: concurrent rounds blamed a healthy link in 2 of 10 runs, one pair at a time in 2 of 30.
    What remains is the machine's: a rank sharing a busy CPU waits for the scheduler tick (4 ms)
    on every exchange, a 1 MiB exchange takes ~1 ms, and a pair that draws that CPU is slow.
    """
    leaders = spec.leaders
    rounds = round_robin(len(leaders))
    if _one_machine(ops, rank in leaders):
        rounds = [[pair] for pairs in rounds for pair in pairs]
    out: dict[str, float] = {}
    for _ in range(spec.pair_repeats):
        for pairs in rounds:
            ops.dist.barrier()  # rounds must not overlap: a rank still busy would be timed as slow
            for a, b in pairs:
                if rank in (leaders[a], leaders[b]):
                    peer = leaders[b] if rank == leaders[a] else leaders[a]
                    seconds = ops.time_pair(spec.pair_size, peer)
                    out[f"{a}-{b}"] = min(out.get(f"{a}-{b}", seconds), seconds)
    return out


def _one_machine(ops: _Ops, leader: bool) -> bool:
    """Whether every node leader runs under one kernel (one boot id): then they share its CPUs."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip() if leader else None
    ids: list[Any] = [None] * ops.spec.world_size
    ops.dist.all_gather_object(ids, boot_id)
    return len({i for i in ids if i is not None}) == 1
