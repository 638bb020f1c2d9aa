"""Re-running a suspect step before the optimizer steps on it: a faulty host, a bad batch, or a one-off fault.

Every rank fingerprints each forward pass: a checksum of the bits of its model chunks' outputs, and its loss where it
computes one (the last pipeline stage). A step is suspect when a rank's output or loss is not finite, its loss is
over `spike_ratio` times the last clean step's, or its share of the gradients is not finite; the ranks agree on that
in one small all-reduce a step. A suspect step is run again before its update (Megatron-LM's rerun state machine has
the idea; this is megaheal's own, on its layout):

1. the same batches on the same ranks. Clean now: the first run met a one-off fault, on the ranks where the two
   runs' fingerprints first differ (pipeline order): `transient`; the second run's gradients are used. Anomalous
   again, and some ranks gave other fingerprints for the same work: those ranks are faulty, `persistent`.
2. anomalous again, and the same twice: every replica's batch moves to another replica (`shift`, chosen to cross
   hosts where the layout lets it) and runs once more. A batch that gives the first run's fingerprints on other
   ranks is itself the cause: `data` (or `state`, when every replica's forward was anomalous: the model is already
   bad, and a rollback is what mends it). A batch that gives other fingerprints on other ranks convicts the side
   whose forward was anomalous, at the stage where the fingerprints first differ: `persistent`.
Then the step's update is skipped (no optimizer step), and rank 0 reports the verdict (wire/rerun.py).

`judge` is the pure part: it takes the fingerprints of the passes, gathered from every rank, and the layout.

What it cannot see: a fault in a backward pass alone leaves every rank's forward as it was, and its gradients are
reduced across the replicas inside the backward: such a step is suspect, but the re-runs can only say whether it
repeats. A layout whose replicas all run through the same host (pipeline stages by host) can name that host but
cannot move the work off it: there the comparison is between the host's own ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from inprocess import waits
from train.param_checksum import ReplicaChecksum, bit_sum
from wire.rerun import RerunVerdict

CHECKSUM_MODULUS = 1 << 52


@dataclass(kw_only=True, slots=True)
class RerunConfig:
    enabled: bool = True
    """Check every step and re-run a suspect one (one all-reduce of one number a step when nothing is suspect)."""
    spike_ratio: float = 3.0
    """A loss over this many times the step before's is suspect (0: only NaN and infinities are)."""
    replica_checksum: bool = True
    """Every step, each data-parallel rank's gathered weights are checked against the shards they came from
    (train/param_checksum.py): a replica that trains on other weights is named that step (dp > 1)."""

    def __post_init__(self) -> None:
        if self.spike_ratio != 0 and self.spike_ratio <= 1:
            raise ValueError(f"spike_ratio must be > 1, or 0 to look at NaN and infinities only, got {self.spike_ratio}")


@dataclass(frozen=True, slots=True)
class Layout:
    """The (pp, dp, tp) mesh: rank = (stage * dp + replica) * tp + tp_rank (train/trainer.py's init_device_mesh)."""

    pp: int
    dp: int
    tp: int

    def rank(self, stage: int, replica: int, tp_rank: int) -> int:
        return (stage * self.dp + replica) * self.tp + tp_rank

    def replica_of(self, rank: int) -> int:
        return (rank // self.tp) % self.dp

    def ranks_of(self, replica: int) -> list[int]:
        return [self.rank(s, replica, t) for s in range(self.pp) for t in range(self.tp)]


@dataclass(frozen=True, slots=True)
class Pass:
    """One pass's fingerprints from every rank: `values[rank]` = (output sum, loss: 0 where it computes none), and
    which ranks were anomalous: in their forward (output or loss), or only in their gradients."""

    values: np.ndarray
    forward: np.ndarray
    gradients: np.ndarray
    diverged: np.ndarray | None = None
    """Which ranks' gathered weights were not their replica group's (train/param_checksum.py); None: not checked."""

    @classmethod
    def of(cls, gathered: np.ndarray) -> Pass:
        return cls(values=gathered[:, :2], forward=gathered[:, 2] > 0, gradients=gathered[:, 3] > 0,
                   diverged=gathered[:, 4] > 0)

    @property
    def flagged(self) -> np.ndarray:
        return self.forward | self.gradients


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: str
    ranks: tuple[int, ...] = ()
    """Whom it blames (transient, persistent)."""
    replicas: tuple[int, ...] = ()
    """The replicas whose batches were suspect."""

    @property
    def keeps_second(self) -> bool:
        """The second run's gradients stand (transient): the step trains as if nothing happened."""
        return self.verdict == "transient"


def same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: whether two fingerprints are equal (NaN equals NaN). Exactly: the same work on the same inputs gives
    the same bits on any healthy device of a kind (a forward pass's kernels are deterministic), and a tolerance would
    let through the very change a flipped bit makes."""
    return np.all((a == b) | (np.isnan(a) & np.isnan(b)), axis=-1)


def suspect_replicas(layout: Layout, first: Pass) -> tuple[int, ...]:
    """The replicas whose batches are suspect: those with an anomalous forward, or every one when only gradients
    were (they are reduced across replicas inside the backward: an anomaly there reaches every replica's shard)."""
    forward = {layout.replica_of(int(r)) for r in np.flatnonzero(first.forward)}
    return tuple(sorted(forward)) if forward else tuple(range(layout.dp))


def unstable(layout: Layout, first: Pass, second: Pass) -> list[int]:
    """The ranks whose results differ between two runs of the same batches on the same ranks, where that first shows
    in each replica (pipeline order): deterministic hardware repeats itself, a faulty one need not."""
    differ = ~same(first.values, second.values)
    return sorted({r for d in range(layout.dp)
                   for r in _origin(layout, d, lambda s, t, d: bool(differ[layout.rank(s, d, t)]))})


def judge(layout: Layout, first: Pass, second: Pass, moved: Pass | None, shift: int) -> Judgement:
    """The verdict on a suspect step from its passes (module docstring): `moved` ran replica r's ranks on the batch
    of replica (r + shift) % dp; None where it was not run (the second pass settled it, or no other replica exists)."""
    suspects = suspect_replicas(layout, first)
    differ = unstable(layout, first, second)
    if not second.flagged.any():
        return Judgement("transient", tuple(differ or _flagged(first)), suspects)
    if differ:
        return Judgement("persistent", tuple(differ), suspects)  # anomalous again, and not the same twice
    if moved is None:
        return Judgement("inconclusive", (), suspects)
    blamed: list[int] = []
    for batch in suspects:
        other = (batch - shift) % layout.dp  # the replica that ran this batch in the moved pass

        def differs(s: int, t: int, batch: int = batch, other: int = other) -> bool:
            a, b = first.values[layout.rank(s, batch, t)], moved.values[layout.rank(s, other, t)]
            return not bool(same(a, b))

        stage = next((s for s in range(layout.pp) if any(differs(s, t) for t in range(layout.tp))), None)
        if stage is None:
            continue  # this batch came out the same on other ranks
        # The side whose forward was anomalous is faulty where the two first differ (both, where neither says).
        mine, theirs = first.forward[layout.ranks_of(batch)].any(), moved.forward[layout.ranks_of(other)].any()
        if mine or not theirs:
            blamed += [layout.rank(stage, batch, t) for t in range(layout.tp)]
        if theirs or not mine:
            blamed += [layout.rank(stage, other, t) for t in range(layout.tp)]
    if not blamed:
        # Every replica's forward anomalous, the same on any ranks: the model itself is (a rollback mends it). Only
        # some replicas', or only the gradients (whose batch cannot be told): the batches are.
        every = all(first.forward[layout.ranks_of(d)].any() for d in range(layout.dp))
        return Judgement("state" if every else "data", (), suspects)
    return Judgement("persistent", tuple(sorted(set(blamed))), suspects)


def _origin(layout: Layout, replica: int, differs: Callable[[int, int, int], bool]) -> list[int]:
    """The ranks of the first stage (pipeline order) of `replica` where `differs(stage, tp_rank, replica)` holds for
    one of its tensor-parallel ranks: all of that stage's (a tensor-parallel group shares its outputs through its
    reduce)."""
    for s in range(layout.pp):
        if any(differs(s, t, replica) for t in range(layout.tp)):
            return [layout.rank(s, replica, t) for t in range(layout.tp)]
    return []


def _flagged(p: Pass) -> list[int]:
    return [int(r) for r in np.flatnonzero(p.flagged)]


def choose_shift(layout: Layout, nodes: list[str]) -> int:
    """How far every replica's batch moves for the third pass: the shift whose replicas share the fewest hosts with
    the ones they take over from (then the one nearest half the replicas)."""
    hosts = [{nodes[r] for r in layout.ranks_of(d)} for d in range(layout.dp)]

    def shared(k: int) -> int:
        return sum(len(hosts[d] & hosts[(d + k) % layout.dp]) for d in range(layout.dp))

    return min(range(1, layout.dp), key=lambda k: (shared(k), abs(2 * k - layout.dp)))


# ---- on the ranks ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the step does after its check."""

    loss: torch.Tensor | None
    """The loss of the pass whose gradients stand."""
    skip: bool = False
    """Skip the step's update: the gradients left are no step's."""
    reported: float | None = None
    """The step's loss to record instead of the all-reduced one (a skipped step's: its clean replicas' mean)."""
    verdict: RerunVerdict | None = None


class Rerunner:
    """The check of every step and the re-runs of a suspect one, on one rank (module docstring)."""

    def __init__(self, cfg: RerunConfig, layout: Layout, chunks: list[nn.Module], device: torch.device,
                 node: str, pipelined: bool = False, checksum: ReplicaChecksum | None = None) -> None:
        """`pipelined`: the chunks are pipeline stages (their first forward is a shape inference); `checksum`: the
        data-parallel replicas' weights compared every step (None: not)."""
        self.cfg, self.layout, self.device, self.node = cfg, layout, device, node
        self.checksum = checksum
        self.last_loss: float | None = None
        """The last clean step's loss (what a spike is measured against)."""
        self.known: str | None = None
        """A verdict that holds for the rest of this trainer's life (persistent, state): later suspect steps are
        skipped without re-running them."""
        self._bits = torch.zeros((), dtype=torch.int64, device=device)
        self._finite = torch.ones((), dtype=torch.bool, device=device)
        self._shift: int | None = None
        self._params = [p for c in chunks for p in c.parameters()]
        self._inferring: set[nn.Module] = set(chunks) if pipelined else set()
        self._handles: list[RemovableHandle] = [c.register_forward_hook(self._add) for c in chunks]

    def _add(self, module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        if module in self._inferring:
            # NOTE: a pipeline stage's first forward is torch's shape inference (pipelining/stage.py, torch 2.13),
            # run on empty buffers: its output is whatever the memory held, not a pass's.
            self._inferring.discard(module)
            return
        # The output's bits summed as integers: any flipped bit changes it, and equal work on two ranks gives equal
        # sums (a float sum hid a saturated attention score below any tolerance). Wraps at 2^64, deterministically.
        self._bits += bit_sum([output], self.device)
        local = output.to_local() if isinstance(output, DTensor) else output
        self._finite &= torch.isfinite(local.detach()).all()

    def begin(self) -> None:
        """A forward pass begins: its fingerprint starts from nothing."""
        self._bits.zero_()
        self._finite.fill_(True)
        if self.checksum is not None:
            self.checksum.begin()

    def check(self, step: int, loss: torch.Tensor | None, rerun: Callable[[int], torch.Tensor | None],
              batch_samples: Callable[[int], tuple[int, int]], attempt: int | None) -> Outcome:
        """After a step's forward and backward: agree whether it is suspect, and if so re-run it (`rerun(shift)`
        runs the step's pass again, every replica on the batch of replica + shift) and judge."""
        mine = self._fingerprint(loss)
        flag = mine[2:].max().reshape(1)
        waits.wait_collective(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), "the step's check")
        if float(flag) == 0:
            return Outcome(loss)
        started = time.perf_counter()
        first = self._gather(mine)
        if first.diverged is not None and first.diverged.any():
            # A replica's weights were not its peers': no re-run is needed to name it, and the reduce already took
            # its gradients into every shard.
            ranks = [int(r) for r in np.flatnonzero(first.diverged)]
            verdict = RerunVerdict(
                step=step, verdict="diverged", what=_what(first) if first.flagged.any() else "weights",
                ranks=ranks, flagged=ranks, replicas=sorted({self.layout.replica_of(r) for r in ranks}),
                skipped=True, seconds=round(time.perf_counter() - started, 4), attempt=attempt)
            return Outcome(loss, skip=True, reported=self._reported(first), verdict=verdict)
        if self.known is not None:
            return Outcome(loss, skip=True, reported=self._reported(first))
        second_loss = self._again(rerun, 0)
        second = self._gather(self._fingerprint(second_loss))
        moved, shift = None, 0
        if second.flagged.any() and self.layout.dp > 1 \
                and not unstable(self.layout, first, second):
            shift = self.shift()
            moved = self._gather(self._fingerprint(self._again(rerun, shift)))
        call = judge(self.layout, first, second, moved, shift)
        if call.verdict in ("persistent", "state"):
            self.known = call.verdict
        verdict = RerunVerdict(
            step=step, verdict=call.verdict, what=_what(first), ranks=list(call.ranks),  # type: ignore[arg-type]
            flagged=_flagged(first), replicas=list(call.replicas),
            samples=[x for d in call.replicas for x in batch_samples(d)], reproduced=bool(second.flagged.any()),
            moved=None if moved is None else call.verdict in ("data", "state"), skipped=not call.keeps_second,
            seconds=round(time.perf_counter() - started, 4), attempt=attempt)
        if call.keeps_second:
            return Outcome(second_loss, verdict=verdict)
        return Outcome(loss, skip=True, reported=self._reported(first), verdict=verdict)

    def _again(self, rerun: Callable[[int], torch.Tensor | None], shift: int) -> torch.Tensor | None:
        self.begin()
        return rerun(shift)

    def note(self, loss: float) -> None:
        """A clean step's loss, what the next one's spike is measured against."""
        if math.isfinite(loss):
            self.last_loss = loss

    def shift(self) -> int:
        if self._shift is None:
            nodes: list[str] = [""] * dist.get_world_size()
            dist.all_gather_object(nodes, self.node)
            self._shift = choose_shift(self.layout, nodes)
        return self._shift

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.checksum is not None:
            self.checksum.close()

    def _fingerprint(self, loss: torch.Tensor | None) -> torch.Tensor:
        """(output sum, loss, forward anomalous, gradients anomalous, weights diverged) of this rank's pass."""
        value = torch.zeros(5, dtype=torch.float64, device=self.device)
        # NOTE: within 2^52, a float64 holds the checksum exactly.
        value[0] = (self._bits % CHECKSUM_MODULUS).double()
        if loss is not None:
            value[1] = loss.detach().double()
        bad = ~self._finite | ~torch.isfinite(value[1])
        ratio, last = self.cfg.spike_ratio, self.last_loss
        if loss is not None and ratio and last is not None and last > 0:
            bad |= value[1] > ratio * last
        value[2] = bad.double()
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self._params
                 if p.grad is not None]
        if grads:
            # NOTE: the local shards only (the reduce already ran): one norm a tensor, no collective.
            value[3] = (~torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())).double()
        if self.checksum is not None:
            value[4] = self.checksum.diverged().double()
        return value

    def _gather(self, mine: torch.Tensor) -> Pass:
        out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        waits.wait_collective(dist.all_gather(out, mine, async_op=True), "a re-run's fingerprints")
        return Pass.of(torch.stack(out).cpu().numpy())

    def _reported(self, first: Pass) -> float:
        """A skipped step's loss: the mean over its clean replicas (every replica's, anomalous, when none is)."""
        last = [self.layout.rank(self.layout.pp - 1, d, 0) for d in range(self.layout.dp)]
        clean = [r for r in last if not first.forward[self.layout.ranks_of(self.layout.replica_of(r))].any()]
        return float(np.mean(first.values[clean or last, 1]))


def _what(first: Pass) -> str:
    if not first.forward.any():
        return "gradient"
    values = first.values[first.forward]
    if np.isnan(values).any():
        return "nan"
    return "inf" if np.isinf(values).any() else "spike"
