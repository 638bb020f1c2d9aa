"""Who holds which rank in a warm pool (healer.launchers.warm_control.WarmControl): a formation numbers the ranks
as torchrun does; a warm restart keeps every survivor's rank and gives a dead one's to a standby of its own host
first; where that cannot be done it says why (the restart is then cold); each host's start order decodes; its plans
are sealed with the key every agent derives from the run's token, and name nothing of what runs."""

from __future__ import annotations

import json

import msgspec
import pytest

from healer.launchers.warm_control import WarmControl, WarmSettings, WarmUnavailable
from wire.orders import StartOrder, Worker, WorkersOrder, decode_order
from wire.run_ids import pool_run_id
from wire.warm_plan import key, read_plan
from wire.warm_seal import SealedStore, pool_key

pytestmark = pytest.mark.unit

NODES = ("n1", "n2")
TOKEN = "t" * 32


@pytest.fixture
def control() -> WarmControl:
    c = WarmControl(WarmSettings(standbys=1), token=TOKEN, job="j", nproc_per_node=2)
    gen = c.form(0, NODES, "first start")
    c.publish(gen, overrides=(), disk_resume="auto")
    return c


def answer(dead: tuple[str, ...] = (), standbys: dict[str, str] | None = None) -> dict[str, list[Worker]]:
    """Each host's answer to a workers order: the formation's workers (alive unless named) and its standbys."""
    out: dict[str, list[Worker]] = {n: [] for n in NODES}
    for node in NODES:
        for local in range(2):
            w = f"{node}.r{local}.a0"
            out[node].append(Worker(id=w, pid=0, alive=w not in dead))
    for w, node in (standbys or {}).items():
        out[node].append(Worker(id=w, pid=0, alive=True))
    return out


def test_a_formation_numbers_ranks_in_host_order_with_local_ranks(control: WarmControl) -> None:
    gen = control.current
    assert gen is not None and gen.kind == "formation"
    assert gen.assign == {"n1.r0.a0": 0, "n1.r1.a0": 1, "n2.r0.a0": 2, "n2.r1.a0": 3}


def test_a_warm_restart_keeps_the_survivors_and_gives_the_lost_rank_to_a_standby_of_its_host(
        control: WarmControl) -> None:
    gen = control.replace(1, NODES, answer(dead=("n2.r1.a0",), standbys={"n1.s1.a0": "n1", "n2.s1.a0": "n2"}),
                          "crash")
    assert gen.kind == "warm" and gen.replaced == {3: "n2.s1.a0"}
    assert gen.assign == {"n1.r0.a0": 0, "n1.r1.a0": 1, "n2.r0.a0": 2, "n2.s1.a0": 3}
    # Without one on its host, a standby of another host of the job takes it.
    other = control.replace(1, NODES, answer(dead=("n2.r1.a0",), standbys={"n1.s1.a0": "n1"}), "crash")
    assert other.replaced == {3: "n1.s1.a0"} and other.node_of["n1.s1.a0"] == "n1"


def test_a_warm_restart_that_cannot_be_made_says_why(control: WarmControl) -> None:
    with pytest.raises(WarmUnavailable, match=r"no standby runs on n2 for rank 3"):
        control.replace(1, NODES, answer(dead=("n2.r1.a0",)), "crash")
    with pytest.raises(WarmUnavailable, match=r"the number of hosts changes \(2 -> 1\)"):
        control.replace(1, ("n1",), answer(), "crash")
    with pytest.raises(WarmUnavailable, match="the hosts are reordered"):
        control.replace(1, ("n2", "n1"), answer(), "crash")
    spare = answer() | {"n3": [Worker(id="n3.s1.a0", pid=0, alive=True)]}
    with pytest.raises(WarmUnavailable, match=r"no standby runs on n3 \(in place of n2\) for rank 3"):
        control.replace(1, ("n1", "n3"), spare, "host lost")
    silent = answer()
    del silent["n2"]
    with pytest.raises(WarmUnavailable, match="the agent of n2 did not answer"):
        control.replace(1, NODES, silent, "crash")
    control.forget()
    with pytest.raises(WarmUnavailable, match="no warm pool runs"):
        control.replace(1, NODES, answer(), "crash")


def test_a_spare_in_a_lost_hosts_place_takes_its_ranks_with_its_own_standbys(control: WarmControl) -> None:
    workers = answer() | {"n3": [Worker(id=f"n3.s{i}.a0", pid=0, alive=True) for i in (1, 2)]}
    del workers["n2"]
    gen = control.replace(1, ("n1", "n3"), workers, "host lost")
    assert gen.nodes == ("n1", "n3") and gen.replaced == {2: "n3.s1.a0", 3: "n3.s2.a0"}
    assert gen.assign == {"n1.r0.a0": 0, "n1.r1.a0": 1, "n3.s1.a0": 2, "n3.s2.a0": 3}
    orders = control.start_orders(gen, spares=("n4",))
    assert orders["n3"].assign == {"n3.s1.a0": 2, "n3.s2.a0": 3} and orders["n3"].local_rank == {"n3.s1.a0": 0,
                                                                                                  "n3.s2.a0": 1}
    # A spare keeps a host's worth of standbys and holds no rank.
    assert orders["n4"].assign == {} and orders["n4"].standbys == 2


def test_a_named_rank_is_replaced_though_its_process_lives_and_is_never_taken_as_a_standby(
        control: WarmControl) -> None:
    gen = control.replace(1, NODES, answer(standbys={"n2.s1.a0": "n2"}), "hang", discard=frozenset({3}))
    assert gen.replaced == {3: "n2.s1.a0"} and "n2.r1.a0" not in gen.assign
    with pytest.raises(WarmUnavailable, match="no standby runs on n2 for rank 3"):
        control.replace(1, NODES, answer(), "hang", discard=frozenset({3}))


def test_each_hosts_start_order_decodes_and_a_malformed_worker_id_is_refused(control: WarmControl) -> None:
    gen = control.replace(1, NODES, answer(dead=("n1.r0.a0",), standbys={"n1.s1.a0": "n1"}), "crash")
    warm = control.start_orders(gen)["n1"]
    order = decode_order(json.dumps({
        "kind": "start", "id": "o1", "epoch": 1, "job": "j", "attempt": 1, "nnodes": 2, "node_rank": 0,
        "nproc_per_node": 2,
        "config": "c.yaml", "run_dir": "/tmp/run", "warm": msgspec.to_builtins(warm)}).encode())
    assert isinstance(order, StartOrder) and order.warm is not None
    assert order.warm.assign == {"n1.s1.a0": 0, "n1.r1.a0": 1} and order.warm.local_rank == {"n1.s1.a0": 0,
                                                                                              "n1.r1.a0": 1}
    assert order.warm.formed_in == 0 and order.warm.control == control.endpoint
    assert isinstance(decode_order(b'{"kind": "workers", "id": "o2", "epoch": 1}'), WorkersOrder)
    with pytest.raises(msgspec.ValidationError, match=r"warm.assign"):
        decode_order(json.dumps({
            "kind": "start", "id": "o3", "epoch": 1, "job": "j", "attempt": 1, "nnodes": 1, "node_rank": 0,
            "nproc_per_node": 1,
            "config": "c", "run_dir": "r", "warm": {"control": "127.0.0.1:1", "formed_in": 0,
                                                   "assign": {"$(reboot)": 0}}}).encode())


def test_plans_are_sealed_with_the_key_each_agent_derives_and_carry_no_config_run_dir_or_path(
        control: WarmControl) -> None:
    agent = SealedStore(control.store, pool_key(TOKEN, pool_run_id("j", 0)))
    assert control.store.get(key("plan", 0)).startswith(b"v1.")
    plan = read_plan(agent, 0)
    assert plan is not None and control.current is not None and plan.assign == control.current.assign
    assert not {"config", "run_dir", "overrides"} & set(json.loads(plan.to_json()))
    assert read_plan(SealedStore(control.store, pool_key("u" * 32, pool_run_id("j", 0))), 0) is None
    # A warm generation changes only the batches to skip; other settings would need new workers (then: cold).
    gen = control.replace(1, NODES, answer(), "rollback")
    with pytest.raises(WarmUnavailable, match=r"settings changed \(parallel.dp=2\)"):
        control.publish(gen, overrides=("parallel.dp=2",), disk_resume="auto", at_most_step=3)
    control.publish(gen, overrides=("skip_steps=[4,3]",), disk_resume="auto", at_most_step=3)
    assert (p := read_plan(agent, 1)) is not None and p.skip_steps == [3, 4] and p.at_most_step == 3
    # A new pool (a cold rollback): another key; the checkpoint by its name in the root the workers were started with.
    control.forget()
    gen = control.form(2, NODES, "rollback")
    control.publish(gen, overrides=("job=j",), disk_resume="/runs/x/checkpoints/step-00000004")
    assert read_plan(agent, 2) is None
    p = read_plan(SealedStore(control.store, pool_key(TOKEN, pool_run_id("j", 2))), 2)
    assert p is not None and p.resume == "disk" and p.disk_resume == "step-00000004"
