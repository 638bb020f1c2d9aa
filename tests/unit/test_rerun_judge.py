"""The verdict of a suspect step's re-runs from the passes' fingerprints (train/rerun.py: judge), on the demo's
layout (2 stages x 2 replicas: n1 holds stage 0, n2 stage 1) and on 4 replicas of one stage."""

from __future__ import annotations

import numpy as np
import pytest

from train.rerun import Layout, Pass, choose_shift, judge

pytestmark = pytest.mark.unit
NAN = float("nan")
DEMO = Layout(pp=2, dp=2, tp=1)  # rank = stage * 2 + replica
DP4 = Layout(pp=1, dp=4, tp=1)


def run(values: list[tuple[float, float]], forward: set[int] = frozenset(), gradients: set[int] = frozenset()) -> Pass:
    n = len(values)
    return Pass(values=np.array(values, dtype=float), forward=np.array([r in forward for r in range(n)]),
                gradients=np.array([r in gradients for r in range(n)]))


CLEAN = [(11.0, 0.0), (12.0, 0.0), (21.0, 4.2), (22.0, 4.1)]


def test_a_fault_the_second_run_does_not_meet_is_transient_on_the_first_stage_that_differed() -> None:
    # rank 2 (stage 1 of replica 0, on n2) flipped a bit: its output and every gradient went bad.
    first = run([(11.0, 0.0), (12.0, 0.0), (99.0, NAN), (22.0, 4.1)], forward={2}, gradients={0, 1, 2, 3})
    call = judge(DEMO, first, run(CLEAN), None, 1)
    assert (call.verdict, call.ranks, call.replicas, call.keeps_second) == ("transient", (2,), (0,), True)


def test_a_fault_that_comes_back_with_other_results_for_the_same_work_is_persistent() -> None:
    first = run([(11.0, 0.0), (12.0, 0.0), (21.0, 4.2), (97.0, 4.1)], gradients={0, 1, 2, 3})
    second = run([(11.0, 0.0), (12.0, 0.0), (21.0, 4.2), (98.0, 4.1)], gradients={0, 1, 2, 3})
    call = judge(DEMO, first, second, None, 1)
    assert (call.verdict, call.ranks, call.keeps_second) == ("persistent", (3,), False)


def test_a_fault_that_repeats_exactly_is_told_from_data_by_moving_the_batches() -> None:
    bad = [(11.0, 0.0), (12.0, 0.0), (21.0, 4.2), (55.0, NAN)]
    # The same anomaly twice on rank 3. Moved: replica 0 runs batch 1 (ranks 0, 2) and gets what rank 3 got: data.
    data = run([(12.0, 0.0), (11.0, 0.0), (55.0, NAN), (21.0, 4.2)], forward={2})
    call = judge(DEMO, run(bad, forward={3}), run(bad, forward={3}), data, 1)
    assert (call.verdict, call.ranks, call.replicas) == ("data", (), (1,))
    # Moved, batch 1 comes out clean on replica 0 while rank 3 is anomalous on batch 0: rank 3 is at fault.
    host = run([(12.0, 0.0), (11.0, 0.0), (22.0, 4.1), (56.0, NAN)], forward={3})
    call = judge(DEMO, run(bad, forward={3}), run(bad, forward={3}), host, 1)
    assert (call.verdict, call.ranks) == ("persistent", (3,))


def test_every_replica_anomalous_the_same_on_any_ranks_is_the_models_state() -> None:
    poisoned = [(NAN, 0.0), (NAN, 0.0), (NAN, NAN), (NAN, NAN)]
    every = run(poisoned, forward={0, 1, 2, 3})
    assert judge(DEMO, every, every, every, 1).verdict == "state"
    # Only the gradients, the same everywhere: no batch can be told, none is applied: data, of every replica.
    grads = run(CLEAN, gradients={0, 1, 2, 3})
    call = judge(DEMO, grads, grads, run([CLEAN[1], CLEAN[0], CLEAN[3], CLEAN[2]], gradients={0, 1, 2, 3}), 1)
    assert (call.verdict, call.replicas) == ("data", (0, 1))


def test_with_one_replica_a_fault_that_repeats_exactly_is_inconclusive() -> None:
    one = Layout(pp=1, dp=1, tp=1)
    bad = run([(5.0, NAN)], forward={0})
    assert judge(one, bad, bad, None, 0).verdict == "inconclusive"


def test_four_replicas_a_flipping_replica_is_named_and_tensor_parallel_ranks_share_the_blame() -> None:
    first = run([(1.0, 4.0), (2.0, 4.0), (3.0, NAN), (4.0, 4.0)], forward={2}, gradients={0, 1, 2, 3})
    second = run([(1.0, 4.0), (2.0, 4.0), (8.0, NAN), (4.0, 4.0)], forward={2}, gradients={0, 1, 2, 3})
    assert judge(DP4, first, second, None, 2).ranks == (2,)
    tp2 = Layout(pp=1, dp=2, tp=2)  # ranks 0-1 replica 0, 2-3 replica 1
    assert judge(tp2, first, second, None, 1).ranks == (2, 3)


def test_the_shift_moves_each_batch_to_replicas_on_other_hosts_where_the_layout_lets_it() -> None:
    assert choose_shift(DP4, ["n1", "n1", "n2", "n2"]) == 2
    assert choose_shift(Layout(pp=1, dp=4, tp=1), ["n1", "n2", "n3", "n4"]) == 2
    assert choose_shift(DEMO, ["n1", "n1", "n2", "n2"]) == 1  # every replica spans both hosts: any will do
