"""A bit flipped in a replica a rank keeps for its peer (tests, chaos): memory that went bad under a held snapshot.

A warm worker keeps its donor's snapshot as the bytes it received (train/warm/replicas.py). A `ReplicaFlip` makes
keeper rank `rank`, once it holds its donor's replica of a step >= `after_step`, flip one bit of it in place: in the
middle of the largest tensor's data (the snapshot's bulk, not the pickle's header), so the bytes still unpickle and
only the checksum can tell. The checksum the owner sent stays as it was. Should the donor then die and a standby take
its rank, the replica handed back fails its checksum and the generation resumes from the disk.

Each flip fires once per run: the rank leaves a mark in the run directory's chaos folder as it flips, and the
attempts after it pass the fault by.
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from train.warm.replicas import Replica, Replicas

FLIPPED_BIT = 0x10
"""The bit flipped in the chosen byte (a low bit of a float32's mantissa in most bytes: a change no range check sees)."""


@dataclass(kw_only=True, slots=True)
class ReplicaFlip:
    rank: int
    """The keeper whose held replica (its donor's snapshot) is corrupted."""
    after_step: int
    """The first snapshot step whose replica may be flipped: the first one held at or after it is."""

    def __post_init__(self) -> None:
        for name in ("rank", "after_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def mark(self) -> str:
        return f"replica-flip-after{self.after_step}-rank{self.rank}.fired"


class ReplicaFlipper:
    """The configured flips of this rank; `maybe(replicas)` is called after each snapshot exchange."""

    def __init__(self, faults: list[ReplicaFlip], rank: int, run_dir: Path) -> None:
        self.marks = run_dir / "chaos"
        self.faults = [f for f in faults if f.rank == rank and not (self.marks / f.mark).exists()]

    def maybe(self, replicas: Replicas) -> None:
        for fault in list(self.faults):
            due = [s for s in replicas.held_steps() if s >= fault.after_step]
            if due:
                self._flip(fault, replicas, due[0])

    def _flip(self, fault: ReplicaFlip, replicas: Replicas, step: int) -> None:
        held = replicas.held[step]
        at = tensor_data_middle(held.payload)
        flipped = bytearray(held.payload)
        flipped[at] ^= FLIPPED_BIT
        replicas.held[step] = Replica(bytes(flipped), held.crc32)  # the owner's checksum, as it was sent
        self.faults.remove(fault)
        self.marks.mkdir(parents=True, exist_ok=True)
        said = (f"rank {fault.rank} flipped bit {FLIPPED_BIT:#x} of byte {at} of {len(flipped)} in the replica of "
                f"rank {replicas.donor} it keeps, step {step}")
        (self.marks / fault.mark).write_text(said + "\n")
        print(f"fault injection: {said}", flush=True)


def tensor_data_middle(payload: bytes) -> int:
    """The offset of the middle byte of the largest tensor's data in a snapshot's bytes (torch.save's zip: each
    storage is an uncompressed member `<archive>/data/<key>`)."""
    with zipfile.ZipFile(io.BytesIO(payload)) as archive:
        storages = [i for i in archive.infolist()
                    if "/data/" in i.filename and i.file_size > 0 and i.compress_type == zipfile.ZIP_STORED]
    if not storages:
        raise ValueError(f"a snapshot of {len(payload)} bytes without tensor data: nothing to flip")
    largest = max(storages, key=lambda i: i.file_size)
    # NOTE: a member's data follows its local header (30 bytes, then its name and extra field, whose lengths are at
    # bytes 26 and 28): the central directory's extra field can differ from the local one, so it is read here.
    name_len, extra_len = struct.unpack_from("<HH", payload, largest.header_offset + 26)
    start = largest.header_offset + 30 + name_len + extra_len
    return start + largest.file_size // 2
