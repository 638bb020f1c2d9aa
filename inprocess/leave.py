"""Leaving a process group so that nothing of it outlives the leaving (see leave_process_group)."""

from __future__ import annotations

import gc

import torch.distributed as dist
from torch.distributed import distributed_c10d


def leave_process_group() -> None:
    """Destroy the process group with nothing left holding it: call it once the trainer is dropped.

    NOTE: modules, DTensors and device meshes hold the group in reference cycles. Left to the interpreter's last
    collection, gloo's worker thread frees a finished work (and its tensors) while the interpreter is finalizing,
    cannot take the GIL, and the process aborts (SIGABRT, "terminate called without an active exception"; seen in
    1 of ~6 runs of a DTensor test, the thread's stack in ~AsyncAllgatherCoalescedWork). Collected here, the group's
    threads end while the interpreter is whole.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    # NOTE: a group without an explicit name is named by a process-wide counter, which destroy_process_group resets
    # but a failed init_process_group leaves counted (torch 2.13): a warm worker whose generation was aborted while
    # its group formed then named its next generation's group "1" while its peers named theirs "0", and every rank
    # waited in the rendezvous for keys nobody wrote (tests/distributed/test_warm_generations.py).
    distributed_c10d._world.group_count = 0
    gc.collect()
