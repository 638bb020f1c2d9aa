"""Naming the rank that holds a hung job from what every rank was doing (healer/detect/hang_attribution.py), on the
shapes the four injected hangs leave on the demo's mesh (2 pipeline stages x 2 data-parallel ranks: ranks 0, 1 in
stage 0, 2, 3 in stage 1), and on the cases where it must say it cannot tell."""

from __future__ import annotations

from typing import Any

import pytest

from healer.detect.hang_attribution import attribute

pytestmark = pytest.mark.unit

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


# ---- from the flight recorders (exporters/flight_recorder.py) ----------------------------------------------------------
# Groups as the demo's mesh makes them: "0" the world, "1", "2" the data-parallel pairs, "3", "4" the pipeline pairs,
# "5" a group of everyone that only the hang injector uses.
GROUPS = {"0": [0, 1, 2, 3], "1": [0, 1], "2": [2, 3], "3": [0, 2], "4": [1, 3], "5": [0, 1, 2, 3]}
BED_GROUPS = {"0": [0, 1, 2, 3], "1": [0, 2], "2": [1, 3], "3": [0, 1], "4": [2, 3], "9": [0, 1, 2, 3]}
"""As the demo's mesh named them on the bed: 1, 2 the pipeline pairs, 3, 4 the data-parallel pairs, 9 the injector's."""


def recorded(r: int, enqueued: dict[str, int], flying: dict[str, str] | None = None, p2p: str | None = None,
             stack: list[str] | None = None, phase: str = "forward_backward",
             named: dict[str, list[int]] = GROUPS) -> dict[str, Any]:
    """Rank `r` having enqueued collective #n of each group ({group: n}), `flying` ({group: op}) still in flight (its
    last enqueued), and a point-to-point operation in flight on group `p2p`."""
    groups = {}
    for g, ranks in named.items():
        if r not in ranks:
            continue
        n = enqueued.get(g, 0)
        flight = [{"op": flying[g], "seq": n, "p2p_seq": 0, "p2p": False, "for_s": 9.0}] if g in (flying or {}) else []
        if g == p2p:
            flight.append({"op": "recv", "seq": 0, "p2p_seq": 7, "p2p": True, "for_s": 9.0})
        groups[g] = {"desc": "", "ranks": ranks, "last_enqueued": n,
                     "last_completed": n - 1 if g in (flying or {}) else n, "in_flight": flight}
    return {**rank(r, phase, stack or ["somewhere (x.py:1)"]), "collectives": {"groups": groups, "at": 0.0}}


def test_the_flight_recorders_name_the_rank_that_never_entered_the_collective_its_peers_wait_in() -> None:
    # Rank 1 spins: rank 0 waits in gather #5 of their dp group; stage 1 waits on a receive from stage 0.
    ranks = [recorded(0, {"1": 5}, {"1": "allgather"}), recorded(1, {"1": 4}),
             recorded(2, {"2": 5}, p2p="3"), recorded(3, {"2": 5}, p2p="4")]
    att = attribute(ranks, MESH)
    assert att.suspects == [1] and not att.ambiguous
    assert att.how == "not in any collective while its peers wait for it (flight recorder)"
    assert att.waits[0] == {"op": "allgather #5 of group 1", "group": "1", "held_up_by": [1]}
    assert att.waits[3]["held_up_by"] == [1] and att.waits[2]["held_up_by"] == [0]


def test_the_flight_recorders_name_the_rank_alone_in_a_collective_of_a_group_no_stack_tells() -> None:
    # Rank 3 skipped its step's collectives and waits in a barrier of group 5 that no one else entered: its data-
    # parallel peer waits for it in a gather, stage 0 on a receive from stage 1. Every rank waits on another.
    ranks = [recorded(0, {"1": 5}, p2p="3"), recorded(1, {"1": 5}, p2p="4"),
             recorded(2, {"2": 5}, {"2": "allgather"}), recorded(3, {"2": 4, "5": 1}, {"5": "barrier"})]
    att = attribute(ranks, MESH)
    assert att.suspects == [3] and not att.ambiguous
    assert att.how.startswith("waits in barrier, a collective none of its peers entered")
    assert "#1 of group 5" in att.how


def test_the_stacks_are_read_when_a_rank_kept_no_flight_recorder() -> None:
    ranks = [recorded(0, {"1": 5}, {"1": "allgather"}, stack=GATHER, phase="dp_gather"),
             rank(1, "forward_backward", ["_spin_in_compute (train/hang_faults.py:70)"], state="R"),
             recorded(2, {"2": 5}, p2p="3", stack=RECV), recorded(3, {"2": 5}, p2p="4", stack=RECV)]
    att = attribute(ranks, MESH)
    assert att.suspects == [1] and "flight recorder" not in att.how


def test_gloos_unrecorded_pipeline_receives_are_read_from_the_stacks_beside_the_recorded_collectives() -> None:
    # The collective hang as gloo's recorders saw it on the bed: stage 0 waits on receives the recorder does not keep
    # (their stacks say so), rank 2 in gather #67 of the dp group "4", rank 3 alone in barrier #1 of group "9".
    bed = dict(named=BED_GROUPS)
    ranks = [recorded(0, {"1": 87}, stack=RECV, **bed), recorded(1, {"2": 69}, stack=RECV, **bed),
             recorded(2, {"4": 67}, {"4": "all_gather"}, stack=GATHER, phase="dp_gather", **bed),
             recorded(3, {"4": 66, "9": 1}, {"9": "barrier"},
                      stack=["barrier (torch/distributed/distributed_c10d.py:1)"], **bed)]
    att = attribute(ranks, MESH)
    assert att.suspects == [3] and att.how.startswith("waits in barrier, a collective none of its peers entered")
    assert att.waits[0] == {"op": "pipeline p2p", "group": "pp", "held_up_by": [2]}
