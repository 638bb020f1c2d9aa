"""megaheal.rank.watch on a DistributedDataParallel model: the wait in DDP's gradient reduce is timed apart from the
rank's own compute (what names a straggler), and the gradients are what DDP makes without it. Two gloo processes;
rank 1 is made late into every backward."""

from __future__ import annotations

import gc
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from megaheal.rank.hooks import Watch
from megaheal.rank.reporter import Reporter
from tests.support import free_port

pytestmark = pytest.mark.multiprocess

LATE_S, STEPS = 0.3, 4


class _Records:
    """A client that keeps what the reporter sends."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def step(self, record: dict[str, Any]) -> None:
        self.steps.append(record)


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    timed, plain = DDP(torch.nn.Linear(8, 2)), DDP(torch.nn.Linear(8, 2))
    plain.load_state_dict(timed.state_dict())
    opt = torch.optim.SGD(timed.parameters(), lr=0.1)
    client = _Records()
    watch = Watch(Reporter(client, None), timed, opt)  # type: ignore[arg-type]
    assert watch.reduce is not None
    reporter = watch.reporter
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
        loss = timed(x).pow(2).sum()
        if rank == 1:
            time.sleep(LATE_S)  # rank 1 computes slowly: rank 0 waits for it in the reduce
        loss.backward()
        plain(x).pow(2).sum().backward()
        for a, b in zip(timed.parameters(), plain.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), "the timed reduce changed the gradients"
        opt.step()
        opt.zero_grad()
        plain.zero_grad()
        plain.load_state_dict(timed.state_dict())
        reporter.step(step)
    torch.save(client.steps, f"{out}/{rank}.pt")
    # NOTE: DDP's reducers (the timed one's comm hook with its callback on gloo's thread) go before the group, and the
    # group only once both ranks are past their last reduce: torn down with them alive, rank 0 was once aborted
    # ("terminate called without an active exception") in a fresh make test.
    watch.remove()
    del timed, plain, opt, watch, reporter
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_peer_waiting_in_ddps_reduce_is_timed_as_dp_reduce_not_as_its_own_compute(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    waiting, late = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    for step in range(1, STEPS):  # NOTE: the first step also waits for DDP's own set-up on both
        w, s = waiting[step]["phases"], late[step]["phases"]
        # Rank 0 computed quickly and waited ~LATE_S for rank 1; rank 1's own backward was the long one.
        assert w["dp_reduce"] > 0.6 * LATE_S and w["forward_backward"] < 0.5 * LATE_S, (step, w)
        assert s["forward_backward"] > 0.8 * LATE_S and s.get("dp_reduce", 0.0) < 0.5 * LATE_S, (step, s)
