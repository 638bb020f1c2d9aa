"""Naming the rank that holds a hung job from what every rank was doing (healer/core/hang_attribution.py), on the
shapes the four injected hangs leave on the demo's mesh (2 pipeline stages x 2 data-parallel ranks: ranks 0, 1 in
stage 0, 2, 3 in stage 1), and on the cases where it must say it cannot tell."""

from __future__ import annotations

from typing import Any

from healer.core.hang_attribution import attribute

MESH = {r: {"pp": r // 2, "dp": r % 2, "tp": 0} for r in range(4)}
GATHER = ["all_gather_into_tensor (torch/distributed/distributed_c10d.py:3800)",
          "foreach_all_gather (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:200)"]
RECV = ["_wait_batch_p2p (torch/distributed/pipelining/schedules.py:600)",
        "step (torch/distributed/pipelining/schedules.py:700)"]
SCALARS = ["all_reduce (torch/distributed/distributed_c10d.py:2900)", "_global_scalars (train/trainer.py:290)"]


def rank(r: int, phase: str | None, stack: list[str], state: str = "S", step: int = 8) -> dict[str, Any]:
    return {"rank": r, "node": f"n{r // 2 + 1}", "state": state, "wchan": None, "stack": stack,
            "phase": {"rank": r, "step": step, "phase": phase, "since": 0.0}}


def test_a_rank_spinning_in_compute_is_named_while_its_peers_wait_in_the_gather_and_the_pipeline() -> None:
    ranks = [rank(0, "dp_gather", GATHER), rank(1, "forward_backward",
                                                ["_spin_in_compute (train/hang_faults.py:70)"], state="R"),
             rank(2, "forward_backward", RECV), rank(3, "forward_backward", RECV)]
    att = attribute(ranks, MESH)
    assert att.suspects == [1] and not att.ambiguous and "not in any collective" in att.how
    assert att.waits[0]["held_up_by"] == [1] and att.waits[3]["held_up_by"] == [1]
    assert att.waits[2]["held_up_by"] == [0], "rank 2 waits for its pipeline peer, which waits for rank 1"
    assert att.groups[0] == {"phase": "forward_backward", "state": "S", "frame": RECV[0], "ranks": [2, 3], "size": 2}


def test_a_rank_blocked_in_data_loading_is_named() -> None:
    ranks = [rank(0, "dp_gather", GATHER), rank(1, "data_wait", ["wait (threading.py:629)",
                                                                 "_block_in_data_loading (train/hang_faults.py:75)"]),
             rank(2, "forward_backward", RECV), rank(3, "forward_backward", RECV)]
    assert attribute(ranks, MESH).suspects == [1]


def test_a_rank_waiting_in_a_collective_none_of_its_peers_entered_is_named_not_the_peers_it_holds_up() -> None:
    barrier = ["barrier (torch/distributed/distributed_c10d.py:4500)",
               "_wait_in_another_collective (train/hang_faults.py:66)"]
    ranks = [rank(0, "dp_gather", GATHER), rank(1, "forward_backward", barrier),
             rank(2, "forward_backward", RECV), rank(3, "forward_backward", RECV)]
    att = attribute(ranks, MESH)
    assert att.suspects == [1] and "barrier" in att.how and "none of its peers entered" in att.how


def test_a_rank_left_behind_in_the_previous_step_is_named_by_its_step() -> None:
    ranks = [rank(0, "dp_gather", GATHER, step=9), rank(1, "checkpoint", ["_block_in_read (train/hang_faults.py:80)"],
                                                           step=8),
             rank(2, "forward_backward", RECV, step=9), rank(3, "forward_backward", RECV, step=9)]
    att = attribute(ranks, MESH)
    assert att.suspects == [1] and att.how == "still in step 8 while the others are past it"


def test_a_rank_blocked_while_its_peers_wait_in_a_collective_whose_group_cannot_be_told_is_named() -> None:
    # A save step: the peers wait in the checkpoint's own collectives, the culprit blocked in a read before them.
    save = ["all_gather_object (torch/distributed/distributed_c10d.py:3100)",
            "gather_object (torch/distributed/checkpoint/utils.py:150)"]
    ranks = [rank(0, "checkpoint", save), rank(1, "checkpoint", ["_block_in_read (train/hang_faults.py:80)"]),
             rank(2, "checkpoint", save), rank(3, "checkpoint", save)]
    att = attribute(ranks, MESH)
    assert att.suspects == [1] and not att.ambiguous and att.waits[0]["held_up_by"] == [1]


def test_the_kernel_states_come_first_and_a_rank_without_a_process_is_named() -> None:
    frozen = [rank(0, "dp_gather", GATHER), rank(1, "forward_backward", [], state="D"),
              rank(2, "forward_backward", RECV), rank(3, "forward_backward", RECV)]
    assert attribute(frozen, MESH).suspects == [1] and "state D" in attribute(frozen, MESH).how
    stopped = [rank(0, "dp_gather", GATHER), rank(1, "forward_backward", [], state="T"), rank(2, None, RECV),
               rank(3, None, RECV)]
    assert attribute(stopped, MESH).how == "process stopped (state T)"
    gone = [{**rank(3, None, []), "state": None}, rank(0, "dp_gather", GATHER)]
    assert attribute(gone, MESH).suspects == [3]


def test_two_ranks_that_each_hold_others_up_are_both_named_and_the_answer_says_it_is_unsure() -> None:
    spin = ["_spin_in_compute (train/hang_faults.py:70)"]
    ranks = [rank(0, "forward_backward", spin, state="R"), rank(1, "dp_reduce", GATHER),
             rank(2, "forward_backward", spin, state="R"), rank(3, "dp_reduce", GATHER)]
    att = attribute(ranks, MESH)
    assert att.suspects == [0, 2] and att.ambiguous


def test_every_rank_waiting_in_the_same_collective_names_every_rank_and_says_so() -> None:
    ranks = [rank(r, "global_scalars", SCALARS) for r in range(4)]
    att = attribute(ranks, MESH)
    assert att.suspects == [0, 1, 2, 3] and att.ambiguous and "every rank" in att.how
