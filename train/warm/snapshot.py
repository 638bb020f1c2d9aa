"""A rank's training state held in memory: what a warm restart resumes from instead of the disk checkpoint.

A snapshot is taken from the same state dict a checkpoint save captures (train/checkpoint/state.py: model,
optimizer, lr schedule, data position, RNG), at a step boundary every rank agrees on. It keeps only this rank's own
part: every DTensor is reduced to its local shard, copied to host memory, so a snapshot pickles without its device
mesh and can be sent to a peer (train/warm/replicas.py) as bytes. It goes back into training objects of the same
layout only (same world size, same rank, same parallel degrees): then every local shard has the shape it had, and
is copied into the fresh objects' own shards as they are. A job that comes back with another layout resumes from
the disk checkpoint, which reshards.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class SnapshotMismatch(ValueError):
    """A snapshot that does not fit the training objects it was to fill (another layout, model or rank)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    step: int
    """Steps done when it was taken: the resumed job goes on with step `step`."""
    rank: int
    layout: str
    """The config's identity (train/checkpoint/state.config_hash): layout, model and schedule."""
    state: dict[str, Any]
    """The state dict with every tensor a plain host tensor (a DTensor's local shard)."""

    @classmethod
    def take(cls, state: dict[str, Any], step: int, rank: int, layout: str) -> Snapshot:
        """Copy `state` (as train.checkpoint.state.capture returns it) out of the training objects."""
        return cls(step=step, rank=rank, layout=layout, state=_local_copy(state))

    def fill(self, template: dict[str, Any], rank: int, layout: str) -> dict[str, Any]:
        """`template` (capture() of fresh objects of the same layout) with this snapshot's values in it, in place."""
        if (rank, layout) != (self.rank, self.layout):
            raise SnapshotMismatch(f"a snapshot of rank {self.rank} (config {self.layout}) cannot resume rank {rank} "
                                   f"(config {layout})")
        return _fill(template, self.state, "state")

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"step": self.step, "rank": self.rank, "layout": self.layout, "state": self.state}, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> Snapshot:
        # NOTE: weights_only: the bytes come from a peer rank of the same job, but unpickling arbitrary objects
        # is never needed (tensors, numbers, strings, lists and dicts only).
        obj = torch.load(io.BytesIO(data), weights_only=True)
        return cls(step=int(obj["step"]), rank=int(obj["rank"]), layout=str(obj["layout"]), state=obj["state"])


def _local_copy(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local().detach().to("cpu", copy=True)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _local_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local_copy(v) for v in value)
    return value


def _fill(template: Any, saved: Any, where: str) -> Any:
    """`saved` copied into `template`'s tensors (their shapes must agree); other values taken from `saved`."""
    if isinstance(template, DTensor) or isinstance(template, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise SnapshotMismatch(f"{where}: a tensor in the training objects, {type(saved).__name__} in the snapshot")
        local = template.to_local() if isinstance(template, DTensor) else template
        if local.shape != saved.shape or local.dtype != saved.dtype:
            raise SnapshotMismatch(f"{where}: shape {tuple(local.shape)} {local.dtype} here, "
                                   f"{tuple(saved.shape)} {saved.dtype} in the snapshot")
        with torch.no_grad():
            local.copy_(saved)
        return template
    if isinstance(template, dict):
        if not isinstance(saved, dict) or set(saved) != set(template):
            missing = sorted(map(str, set(template) - set(saved))) if isinstance(saved, dict) else []
            raise SnapshotMismatch(f"{where}: the snapshot's entries differ (missing: {', '.join(missing[:5])})")
        for key in template:
            template[key] = _fill(template[key], saved[key], f"{where}.{key}")
        return template
    if isinstance(template, (list, tuple)) and isinstance(saved, (list, tuple)) and len(template) == len(saved):
        return type(template)(_fill(t, s, f"{where}[{i}]") for i, (t, s) in enumerate(zip(template, saved)))
    return _local_copy(saved)
