"""Checkpoint fault injection: a storage writer whose write fails as a full disk does, or goes no faster than a
throttled store lets it, and the same failure at each step of a save's commit on rank 0 (manifest, `latest`,
retention, events.jsonl)."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult


class FailingWriter(FileSystemWriter):
    """FileSystemWriter that, when `fail` is set, raises ENOSPC on the job's last rank, and with `mib_per_s` set
    takes as long as writing at that rate would.

    Only one rank fails, as when one node's disk fills up: the other ranks write normally and
    learn of the failure through DCP's gathering of write results, so the whole save fails.
    The throttle holds every rank's write until its bytes would have gone out at `mib_per_s` (a slow or
    overloaded store: the save is slow, nothing is wrong). With neither set it is exactly FileSystemWriter.
    """

    def __init__(self, path: str | os.PathLike, fail: bool = False, mib_per_s: float = 0.0) -> None:
        super().__init__(path)
        self._fail = fail
        self._mib_per_s = mib_per_s

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        last_rank = dist.get_world_size() - 1 if dist.is_initialized() else 0
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self._fail and rank == last_rank:
            raise OSError(errno.ENOSPC, f"No space left on device (injected fault) writing {self.path}")
        started = time.monotonic()
        written = super().write_data(plan, planner)
        if self._mib_per_s > 0:
            # NOTE: FileSystemWriter writes before it returns (the future is already done); an async save runs
            # all of this on its background thread, so only what waits for the save waits for the throttle.
            size = sum(r.storage_data.length for r in written.wait())  # a torch.futures.Future
            time.sleep(max(0.0, size / (self._mib_per_s * 2**20) - (time.monotonic() - started)))
        return written


COMMIT_STAGES = ("manifest", "latest", "retention", "events")
"""The steps of rank 0's commit, in order, that checkpoint.fail_commit_at can make fail."""


def commit_fault(plan: Mapping[str, list[int]], stage: str, step: int) -> None:
    """Raise ENOSPC, as a full disk would, at `stage` of the save of `step` when `plan` (checkpoint.fail_commit_at,
    stage -> steps) says so; nothing otherwise."""
    if step in plan.get(stage, ()):
        raise OSError(errno.ENOSPC, f"No space left on device (injected fault) writing the {stage} of step {step}")
