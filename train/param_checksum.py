"""Does every data-parallel replica train on the same weights? A checksum of each rank's gathered parameters against
the sum of the shards they were gathered from, every step.

Under ZeRO-2 (FSDP2 here) each data-parallel rank keeps one shard of every parameter and all-gathers the whole before
its forward: for that step every replica holds a full copy, and the copies must be equal. A copy that is not (a bit
flipped in the gathered buffer, in the memory that holds it or on the link that filled it) trains its replica on
other weights, and its gradients go into every shard at the reduce. So each rank sums the bits of its gathered
parameters (as integers, wrapping at 2^64: every flipped bit changes the sum), and of its own shards before the
gather; the shards' sums added over the data-parallel group are what every gathered copy must sum to. A rank whose
copy does not is named the step it happens, before the update (train/rerun.py skips it).

Cost: a pass over the rank's shards and one over its gathered parameters (reads, no copies), and one all-reduce of one
integer over the data-parallel group, a step. Without data parallelism (dp 1) there is nothing to compare.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from inprocess import waits

_INT_OF = {4: torch.int32, 2: torch.int16, 1: torch.int8}


def bit_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bits of `tensors` summed as integers (int64, wrapping)."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    for t in tensors:
        local = (t.to_local() if isinstance(t, DTensor) else t).detach()
        if local.numel():
            total += local.reshape(-1).view(_INT_OF.get(local.element_size(), torch.int64)).sum(dtype=torch.int64)
    return total


class ReplicaChecksum:
    """One rank's side of the comparison: `begin()` before a forward pass (the parameters are shards), the chunks'
    first forwards add their gathered copies, `diverged()` after it (one all-reduce over the data-parallel group)."""

    def __init__(self, chunks: list[nn.Module], group: dist.ProcessGroup, device: torch.device,
                 pipelined: bool = False) -> None:
        self.chunks, self.group, self.device = chunks, group, device
        self._shards = torch.zeros((), dtype=torch.int64, device=device)
        self._gathered = torch.zeros((), dtype=torch.int64, device=device)
        self._seen: set[nn.Module] = set()
        # NOTE: a pipeline stage's first forward is torch's shape inference, on the same (gathered) parameters: it
        # would count them twice; seen from the start, it counts nothing until the first begin().
        self._inferring: set[nn.Module] = set(chunks) if pipelined else set()
        self._handles: list[RemovableHandle] = [c.register_forward_hook(self._gathered_now) for c in chunks]

    def begin(self) -> None:
        self._shards = bit_sum([p for c in self.chunks for p in c.parameters()], self.device)
        self._gathered = torch.zeros((), dtype=torch.int64, device=self.device)
        self._seen = set()

    def _gathered_now(self, module: nn.Module, inputs: object, output: object) -> None:
        if module in self._inferring:
            self._inferring.discard(module)
            return
        if module in self._seen:
            return  # a later microbatch: the same copy
        self._seen.add(module)
        # NOTE: FSDP2 left the gathered parameters registered after the forward (reshard_after_forward=False, the
        # ZeRO-2 layout): this runs after its own post-forward hook, registered first.
        self._gathered += bit_sum(list(module.parameters()), self.device)

    def diverged(self) -> torch.Tensor:
        """Whether this rank's gathered copy differs from the sum of the data-parallel group's shards (a bool)."""
        expected = self._shards.clone()
        waits.wait_collective(dist.all_reduce(expected, group=self.group, async_op=True), "the replicas' checksum")
        return self._gathered != expected

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
