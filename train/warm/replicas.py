"""Every rank's snapshot also lives on a peer, so a rank that dies can be replaced without the disk.

Rank r keeps its own snapshots and a replica of its donor's, where donor(r) = (r - stride) mod world, and sends its
own to its keeper, (r + stride) mod world. The stride is the number of ranks per host when the job spans hosts (the
replica then lives on another host and survives the loss of a whole one), else 1. The exchange runs after each
snapshot, on a gloo group of its own (host tensors, also under NCCL), in the training thread: it is a point-to-point
pair per rank, about as long as sending one rank's state once.

The last `keep` snapshots are kept on both sides: a crash in the middle of an exchange leaves some ranks with the
newest and some with the one before, and the restart takes the newest step every rank still has.
"""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist

from train.warm.snapshot import Snapshot

TRANSFER_TIMEOUT = timedelta(seconds=120)


def keeper_of(rank: int, world: int, stride: int) -> int:
    """The rank that holds `rank`'s replica."""
    return (rank + stride) % world


def replica_stride(world: int, per_host: int) -> int:
    """Ranks per host when the job spans more than one host, else 1 (a rank's replica on a neighbour)."""
    return per_host if 1 <= per_host < world and world % per_host == 0 else 1


class Replicas:
    def __init__(self, rank: int, world: int, stride: int, keep: int = 2,
                 group: dist.ProcessGroup | None = None) -> None:
        if world > 1 and stride % world == 0:
            raise ValueError(f"a replica stride of {stride} keeps every rank's replica on itself (world {world})")
        self.rank, self.world, self.stride, self.keep = rank, world, stride, keep
        self.group = group
        self.own: OrderedDict[int, Snapshot] = OrderedDict()
        """step -> this rank's snapshot."""
        self.held: OrderedDict[int, bytes] = OrderedDict()
        """step -> the donor's snapshot, as it was sent."""

    @property
    def donor(self) -> int:
        return (self.rank - self.stride) % self.world

    @property
    def keeper(self) -> int:
        return keeper_of(self.rank, self.world, self.stride)

    def add(self, snap: Snapshot) -> None:
        """Keep `snap` and exchange it: ours to our keeper, our donor's to us (every rank calls this together)."""
        _put(self.own, snap.step, snap, self.keep)
        if self.world > 1:
            _put(self.held, snap.step, self._exchange(snap.to_bytes()), self.keep)

    def _exchange(self, payload: bytes) -> bytes:
        received = _transfer(payload, self.keeper, self.donor, self.group)
        assert received is not None
        return received

    def steps(self) -> list[int]:
        """The steps this rank can resume itself from, newest first."""
        return sorted(self.own, reverse=True)

    def held_steps(self) -> list[int]:
        """The steps of the donor's replica this rank holds, newest first."""
        return sorted(self.held, reverse=True)

    def forget(self) -> None:
        self.own.clear()
        self.held.clear()


def _put(book: OrderedDict, step: int, value: object, keep: int) -> None:
    book[step] = value
    book.move_to_end(step)
    while len(book) > keep:
        book.popitem(last=False)


def _transfer(payload: bytes | None, to: int, src: int | None, group: dist.ProcessGroup | None) -> bytes | None:
    """Send `payload` (None: nothing) to rank `to` while receiving from rank `src` (None: nothing): its size first,
    then its bytes. Both directions are posted at once, so ranks that send around a ring do not deadlock."""
    # NOTE: ranks are global; with a group of all ranks (the only kind used here) they are also the group's.
    def both(out: torch.Tensor | None, into: torch.Tensor | None) -> None:
        ops = ([dist.isend(out, to, group=group)] if out is not None else []) + \
              ([dist.irecv(into, src, group=group)] if into is not None else [])
        for op in ops:
            op.wait(timeout=TRANSFER_TIMEOUT)

    out = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None else None
    size_in = torch.zeros(1, dtype=torch.int64) if src is not None else None
    both(torch.tensor([out.numel()], dtype=torch.int64) if out is not None else None, size_in)
    incoming = torch.empty(int(size_in.item()), dtype=torch.uint8) if size_in is not None else None
    both(out, incoming)
    return incoming.numpy().tobytes() if incoming is not None else None


def common_step(own: list[list[int]], held: list[list[int]], stride: int,
                at_most: int | None = None) -> int | None:
    """The newest step every rank can resume from, its own snapshot or the replica its keeper holds; None: none.

    `own[r]`, `held[r]`: the steps rank r has of its own state and of its donor's (a fresh rank has none)."""
    world = len(own)
    common: set[int] | None = None
    for r in range(world):
        steps = set(own[r]) | set(held[keeper_of(r, world, stride)] if world > 1 else ())
        common = steps if common is None else common & steps
    eligible = [s for s in common or () if at_most is None or s <= at_most]
    return max(eligible) if eligible else None


def gather_resume_state(replicas: Replicas, at_most: int | None = None) -> Snapshot | None:
    """Every rank together: agree on the step to resume from and hand each rank its snapshot of it, a replaced
    rank's from the peer that keeps its replica. None on every rank: no step is held by all (resume from disk)."""
    world = replicas.world
    mine = {"own": replicas.steps(), "held": replicas.held_steps()}
    gathered: list[dict[str, list[int]]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, mine, group=replicas.group)
    step = common_step([g["own"] for g in gathered], [g["held"] for g in gathered], replicas.stride, at_most)
    if step is None:
        replicas.forget()
        return None
    # Ranks without their own snapshot of `step` get it from their keeper; each rank serves at most its donor.
    donor_needs = step not in gathered[replicas.donor]["own"]
    needs = step not in replicas.own
    received = _transfer(replicas.held[step] if donor_needs else None, replicas.donor,
                         replicas.keeper if needs else None, replicas.group)
    snap = replicas.own.get(step)
    if received is not None:
        snap = Snapshot.from_bytes(received)
        _put(replicas.own, step, snap, replicas.keep)
    for book in (replicas.own, replicas.held):
        for newer in [s for s in book if s > step]:
            del book[newer]  # states of steps the job will do again: they are not this run's any more
    return snap
