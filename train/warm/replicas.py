"""Every rank's snapshot also lives on a peer, so a rank that dies can be replaced without the disk.

Rank r keeps its own snapshots and a replica of its donor's, where donor(r) = (r - stride) mod world, and sends its
own to its keeper, (r + stride) mod world. The stride is the number of ranks per host when the job spans hosts (the
replica then lives on another host and survives the loss of a whole one), else 1. The exchange runs after each
snapshot, on a gloo group of its own (host tensors, also under NCCL), in the training thread: it is a point-to-point
pair per rank, about as long as sending one rank's state once.

The last `keep` snapshots are kept on both sides: a crash in the middle of an exchange leaves some ranks with the
newest and some with the one before, and the restart takes the newest step every rank still has.

A replica travels and is held with the CRC32 its owner computed before sending it; the rank it is handed back to
checks it before unpickling it, and one replica that fails makes every rank of the generation resume from the disk
checkpoint instead, with the reason.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from train.warm.snapshot import Snapshot

TRANSFER_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True, slots=True)
class Replica:
    """A snapshot's bytes as its owner sent them, and the CRC32 the owner computed of them before sending."""

    payload: bytes
    crc32: int

    @classmethod
    def of(cls, payload: bytes) -> Replica:
        # NOTE: CRC32, not a cryptographic hash: what it guards against is a bit flipped in a keeper's memory or on
        # the wire, not a forger (the peers are ranks of the same job), and CRC32 detects every single-bit error and
        # every burst of up to 32 bits, at less than half SHA-256's cost, which counts on a state of several GB:
        # 0.25 ms per MB (4 GB/s) against SHA-256's 0.58, on a 10.6 MB snapshot of configs/demo.yaml's model, one
        # core of this project's 2-core machine under load (2026-12). The owner pays it once per snapshot; the
        # rank handed the replica back pays it once per restart, before unpickling.
        return cls(payload, zlib.crc32(payload))

    def intact(self) -> bool:
        return zlib.crc32(self.payload) == self.crc32


@dataclass(frozen=True, slots=True)
class Resume:
    """What gather_resume_state hands a rank: the snapshot to resume from, or None (the disk) and why."""

    snapshot: Snapshot | None
    why: str = ""
    """Why the generation resumes from the disk (empty when it resumes from memory)."""


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
        self.held: OrderedDict[int, Replica] = OrderedDict()
        """step -> the donor's snapshot, as it was received (with its owner's checksum)."""

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
            _put(self.held, snap.step, self._exchange(Replica.of(snap.to_bytes())), self.keep)

    def _exchange(self, replica: Replica) -> Replica:
        received = _transfer(replica, self.keeper, self.donor, self.group)
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


def _transfer(out: Replica | None, to: int, src: int | None, group: dist.ProcessGroup | None) -> Replica | None:
    """Send `out` (None: nothing) to rank `to` while receiving from rank `src` (None: nothing): its size and checksum
    first, then its bytes. Both directions are posted at once, so ranks that send around a ring do not deadlock."""
    # NOTE: ranks are global; with a group of all ranks (the only kind used here) they are also the group's.
    def both(send: torch.Tensor | None, into: torch.Tensor | None) -> None:
        ops = ([dist.isend(send, to, group=group)] if send is not None else []) + \
              ([dist.irecv(into, src, group=group)] if into is not None else [])
        for op in ops:
            op.wait(timeout=TRANSFER_TIMEOUT)

    data = torch.frombuffer(bytearray(out.payload), dtype=torch.uint8) if out is not None else None
    head_in = torch.zeros(2, dtype=torch.int64) if src is not None else None
    both(torch.tensor([len(out.payload), out.crc32], dtype=torch.int64) if out is not None else None, head_in)
    incoming = torch.empty(int(head_in[0].item()), dtype=torch.uint8) if head_in is not None else None
    both(data, incoming)
    if incoming is None or head_in is None:
        return None
    return Replica(incoming.numpy().tobytes(), int(head_in[1].item()))


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


def gather_resume_state(replicas: Replicas, at_most: int | None = None) -> Resume:
    """Every rank together: agree on the step to resume from and hand each rank its snapshot of it, a replaced
    rank's from the peer that keeps its replica. On every rank alike, a Resume without a snapshot (resume from disk)
    when no step is held by all, or when a replica handed back fails its checksum."""
    world = replicas.world
    mine = {"own": replicas.steps(), "held": replicas.held_steps()}
    gathered: list[dict[str, list[int]]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, mine, group=replicas.group)
    step = common_step([g["own"] for g in gathered], [g["held"] for g in gathered], replicas.stride, at_most)
    if step is None:
        replicas.forget()
        return Resume(None, "no state in memory held by every rank")
    # Ranks without their own snapshot of `step` get it from their keeper; each rank serves at most its donor.
    donor_needs = step not in gathered[replicas.donor]["own"]
    needs = step not in replicas.own
    received = _transfer(replicas.held[step] if donor_needs else None, replicas.donor,
                         replicas.keeper if needs else None, replicas.group)
    failures = _agree_intact(replicas, received, step)
    if failures:
        # NOTE: every snapshot is forgotten, not only the bad one: the generation goes back to the disk's step, so
        # the books start again from there on every rank alike (each rank's steps and its keeper's stay in step), and
        # the other replicas in the memory that flipped a bit are no better trusted than the one that was caught.
        replicas.forget()
        return Resume(None, "; ".join(failures))
    snap = replicas.own.get(step)
    if received is not None:
        snap = Snapshot.from_bytes(received.payload)
        _put(replicas.own, step, snap, replicas.keep)
    for book in (replicas.own, replicas.held):
        for newer in [s for s in book if s > step]:
            del book[newer]  # states of steps the job will do again: they are not this run's any more
    return Resume(snap)


def _agree_intact(replicas: Replicas, received: Replica | None, step: int) -> list[str]:
    """Every rank together: what failed among the replicas handed back (checked before any is unpickled), the same
    list on every rank; empty when all were intact."""
    verdict = None if received is None or received.intact() else \
        f"replica of rank {replicas.rank} kept by rank {replicas.keeper} failed its checksum at step {step}"
    verdicts: list[str | None] = [None] * replicas.world
    dist.all_gather_object(verdicts, verdict, group=replicas.group)
    return [v for v in verdicts if v is not None]
