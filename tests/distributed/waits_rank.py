"""One of two gloo ranks for tests/distributed/test_interruptible_waits.py.

    python -m tests.distributed.waits_rank RANK PORT CASE     (from the repository's root)

Rank 0 prints one JSON line: what its wait did. CASE:
- receive-plain: rank 1 sends 400 MB; rank 0 shuts its sockets down (inprocess/abort.py) once the payload is being
  read, and waits for the receive as gloo does, untimed, for WATCH_S;
- receive-armed: the same, rank 0 waiting through inprocess/waits.py with its generation's interrupt set after the
  shutdown (as inprocess/generations.py does);
- collective-armed: rank 1 joins an all-reduce late, then rank 0 waits on one rank 1 never joins, its interrupt set
  while it waits.
- dtensor-armed: rank 0 sums a sharded DTensor (`full_tensor`: DTensor's own collective, which waits inside a C++ op)
  through `waits.call`, once with rank 1, then once more without it, its interrupt set while it waits.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from inprocess import waits
from inprocess.abort import GenerationSockets

ELEMENTS = 100_000_000
"""400 MB of float32: read for long enough (~0.1-0.5 s here) that the shutdown lands inside the payload."""
WATCH_S = 5.0
INTERRUPT_AFTER_S = 0.5


def main() -> None:
    rank, port, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sockets = GenerationSockets()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    if case.startswith("receive"):
        _receive(rank, case, sockets)
    elif case == "dtensor-armed":
        _dtensor(rank)
    else:
        _collective(rank)
    sys.stdout.flush()
    os._exit(0)


def _receive(rank: int, case: str, sockets: GenerationSockets) -> None:
    if rank == 1:
        try:
            dist.send(torch.ones(ELEMENTS), dst=0)
        except RuntimeError:
            pass  # rank 0 shut the connection down under it
        time.sleep(WATCH_S + 5)
        return
    received = torch.zeros(ELEMENTS)
    work = dist.irecv(received, src=1)
    interrupt = waits.arm(0) if case == "receive-armed" else None
    outcome: dict[str, object] = {}
    done = threading.Event()

    def wait() -> None:
        try:
            if interrupt is None:
                work.wait()
            else:
                waits.wait_point_to_point(work.wait)
            outcome["wait"] = "returned"
        except Exception as exc:  # noqa: BLE001 - what the wait raised is the result
            outcome["wait"] = f"{type(exc).__name__}: {exc}"
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    deadline = time.monotonic() + 30
    while received[0].item() == 0 and time.monotonic() < deadline:  # the payload's first bytes are in
        time.sleep(0.001)
    mid_payload = received[0].item() == 1 and received[-1].item() == 0
    shut = sockets.abort("gloo")
    shut_at = time.monotonic()
    if interrupt is not None:
        interrupt.set()
    released = done.wait(WATCH_S)
    print(json.dumps({"mid_payload": mid_payload, "shut": shut, "released": released,
                      "after_s": round(time.monotonic() - shut_at, 3), **outcome}), flush=True)


def _collective(rank: int) -> None:
    late = torch.full((4,), float(rank + 1))
    if rank == 1:
        time.sleep(1.0)
        dist.all_reduce(late)
        time.sleep(WATCH_S + 5)  # and never joins the second
        return
    interrupt = waits.arm(0)
    work = dist.all_reduce(late, async_op=True)
    waits.wait_collective(work)  # some slices pass before rank 1 joins
    never = dist.all_reduce(torch.ones(4), async_op=True)
    threading.Timer(INTERRUPT_AFTER_S, interrupt.set).start()
    started = time.monotonic()
    try:
        waits.wait_collective(never)
        raised = None
    except waits.GenerationAborted as exc:
        raised = str(exc)
    print(json.dumps({"late_sum": late.tolist(), "raised": raised,
                      "after_s": round(time.monotonic() - started, 3)}), flush=True)


def _dtensor(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (2,))
    partial = DTensor.from_local(torch.full((4,), float(rank + 1)), mesh, [Partial()])
    if rank == 1:
        partial.full_tensor()
        time.sleep(WATCH_S + 5)  # and never joins the second
        return
    interrupt = waits.arm(0)
    summed = waits.call(lambda: partial.full_tensor(), "a DTensor's sum")
    threading.Timer(INTERRUPT_AFTER_S, interrupt.set).start()
    started = time.monotonic()
    try:
        waits.call(lambda: partial.full_tensor(), "a DTensor's sum")
        raised = None
    except waits.GenerationAborted as exc:
        raised = str(exc)
    print(json.dumps({"sum": summed.tolist(), "raised": raised, "after_s": round(time.monotonic() - started, 3)}),
          flush=True)


if __name__ == "__main__":
    main()
