"""Leaving a process group so that nothing of it outlives the leaving (see leave_process_group)."""

from __future__ import annotations

import gc
import threading

import torch.distributed as dist
from torch.distributed import distributed_c10d

RELEASE_WAIT_S = 5.0
"""How long leaving waits for its groups' destructors (milliseconds, unless gloo holds a transfer it lost: then the
group's timeout) before it goes on without them."""


def leave_process_group() -> None:
    """Destroy the process group with nothing left holding it: call it once the trainer is dropped.

    NOTE: modules, DTensors and device meshes hold the group in reference cycles. Left to the interpreter's last
    collection, gloo's worker thread frees a finished work (and its tensors) while the interpreter is finalizing,
    cannot take the GIL, and the process aborts (SIGABRT, "terminate called without an active exception"; seen in
    1 of ~6 runs of a DTensor test, the thread's stack in ~AsyncAllgatherCoalescedWork). Collected here, the group's
    threads end while the interpreter is whole.

    NOTE: the groups' last references are dropped on a thread of their own. A gloo group's destructor joins its worker
    threads, and gloo does not wake a send or receive that was on the wire when its connection closed (a peer died,
    or the generation was aborted: inprocess/waits.py): that worker waits for the group's timeout, and a rank leaving
    an aborted generation sat in the destructor until it was deemed stuck (tests/distributed/test_warm_generations.py,
    native stacks: ~ProcessGroupGloo -> thread::join, the worker in UnboundBuffer::waitSend under gloo::allgather).
    The destructor runs without the GIL (torch's bindings release it), so the thread holds nothing else up; leaving
    waits for it RELEASE_WAIT_S at most.
    """
    gc.collect()
    groups = list(distributed_c10d._world.pg_map) if dist.is_initialized() else []
    if dist.is_initialized():
        dist.destroy_process_group()
    # NOTE: a group without an explicit name is named by a process-wide counter, which destroy_process_group resets
    # but a failed init_process_group leaves counted (torch 2.13): a warm worker whose generation was aborted while
    # its group formed then named its next generation's group "1" while its peers named theirs "0", and every rank
    # waited in the rendezvous for keys nobody wrote (tests/distributed/test_warm_generations.py).
    distributed_c10d._world.group_count = 0
    gc.collect()
    if groups:
        release = threading.Thread(target=groups.clear, daemon=True, name="megaheal-group-release")
        release.start()
        # NOTE: waited for, a bounded time: a process that exits right after leaving (a plain run) must not finalize
        # its interpreter while the destructors run (SIGABRT at every exit of tests/distributed/test_pipeline_waits.py
        # when this was not waited for).
        release.join(RELEASE_WAIT_S)
