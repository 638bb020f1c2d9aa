"""A foreign client cannot write the warm store: a client that reaches a pool's store (inprocess/store.py) without the
pool's key writes a plan of its own, the newest generation's number, a plan that would abort the running generation,
and the pool's hello and ready keys. A worker's loop (inprocess/generations.py) runs nothing from them, keeps its
generation, and takes the genuine plan written after them; the pool does not count the forged workers as up or
ready; each refusal is counted. One rank of gloo in the test's process."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from inprocess.generations import GenerationLoop
from inprocess.store import BoundStore
from wire.warm_plan import Plan, key, write_plan
from wire.warm_seal import SealedStore, new_key

pytestmark = pytest.mark.multiprocess

FORGED = json.dumps({"generation": 0, "world": 1, "assign": {"w0": 0}, "local_rank": {"w0": 0},
                     "config": "/tmp/evil.yaml", "run_dir": "/tmp", "overrides": [], "disk_resume": "/tmp/evil"})


def _until(what: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_a_client_without_the_pools_key_cannot_plan_abort_or_fake_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGAHEAL_ATTEMPT"):  # the loop sets them: restored after
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    secret = new_key()
    bound = BoundStore("127.0.0.1", timedelta(seconds=10))
    pool = SealedStore(bound.store, secret)

    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", bound.port, is_master=False, timeout=timedelta(seconds=10))

    foreign = client()
    foreign.set(key("gen"), "0")
    foreign.set(key("plan", 0), FORGED)
    foreign.set(key("hello", "w9"), "4242")
    foreign.set(key("ready", 0, "w9"), "memory step 8 in 0.1 s")
    ran: list[Plan] = []
    refused_next: list[str] = []

    def run(plan: Plan, ready: object) -> None:
        ran.append(plan)
        ready("disk")  # type: ignore[operator]
        # A plan of the next generation would abort this one in every rank (the watcher's thread reads it).
        foreign.set(key("plan", 1), FORGED.replace('"generation": 0', '"generation": 1'))
        _until(lambda: loop.watching is not None and key("plan", 1) in loop.watching.refused)
        refused_next.append(key("plan", 1))

    loop = GenerationLoop(client(), "w0", watch=client(), connect=client, secret=secret)
    outcome: list[int] = []
    serving = threading.Thread(target=lambda: outcome.append(loop.serve(run)), daemon=True)
    serving.start()
    _until(lambda: pool.has(key("hello", "w0")))
    _until(lambda: key("plan", 0) in loop.sealed.refused)
    time.sleep(0.3)  # several of the loop's looks at the forged plan
    assert not ran, "a forged plan was run"
    assert not pool.has(key("hello", "w9")) and not pool.has(key("ready", 0, "w9"))
    assert pool.refused == {key("hello", "w9"): 1, key("ready", 0, "w9"): 1}

    write_plan(pool, Plan(generation=0, world=1, assign={"w0": 0}, local_rank={"w0": 0}, resume="disk"))
    serving.join(timeout=30)
    assert outcome == [0] and [p.generation for p in ran] == [0] and ran[0].disk_resume == "auto"
    # The forged next plan was seen and refused while the generation ran, which ended as it would have.
    assert refused_next and pool.get(key("end", 0, "w0")) == "ok"
    assert pool.get(key("ready", 0, "w0")) is not None and pool.get(key("ready", 0, "w0")).startswith("disk in ")
