"""Every parallel layout trains the same model as one process: same seed, same batches, same losses.

Each case runs a real torchrun job on gloo and compares its per-step losses with a single
process that holds the whole model and the whole global batch.
"""

from __future__ import annotations

import itertools

import pytest

from tests.conftest import run_training

STEPS = 3
# A higher learning rate than the configs' so that any divergence in the update shows in the loss by step 3.
COMMON = [f"steps={STEPS}", "optim.lr=1.0e-2", "optim.warmup_steps=1"]
SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.tp=1", "parallel.virtual_stages=1", "parallel.microbatches=1"]

CASES = {
    # name: (config, world size, extra overrides applied to both runs)
    "dp4": ("tiny-dp4.yaml", 4, []),
    "dp2-tp2-sequence-parallel-window-lamb": (
        "tiny-dp4.yaml", 4, ["parallel.dp=2", "parallel.tp=2", "model.window=16", "optim.name=lamb"]),
    "pp2-interleaved-tp2-parallel-block-lamb": ("tiny-tp2pp2.yaml", 4, ["model.parallel_block=true"]),
    "pp2-dp2-tp2": ("tiny-3d.yaml", 8, ["model.parallel_block=true", "model.window=24"]),
}


def _losses(records: dict[int, list[dict]]) -> list[float]:
    return [r["loss"] for r in records[0]]


@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_layout_matches_a_single_process(case: str, tmp_path) -> None:
    config, world, extra = CASES[case]
    parallel = run_training(tmp_path / "parallel", config, COMMON + extra, nproc=world)
    single = run_training(tmp_path / "single", config, COMMON + extra + SINGLE)

    assert sorted(parallel) == list(range(world)), "every rank writes its JSON lines"
    expected = _losses(single)
    assert len(expected) == STEPS
    for rank, records in parallel.items():
        got = [r["loss"] for r in records]
        assert got == pytest.approx(expected, rel=1e-4), f"rank {rank} of {case}"
        norms = [r["grad_norm"] for r in records]
        assert norms == pytest.approx([r["grad_norm"] for r in single[0]], rel=1e-3), f"rank {rank} grad norms"
    assert expected[-1] < expected[0], "training lowers the loss"


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_3d_run_records_every_rank_with_its_mesh_coordinates_and_phases(tmp_path) -> None:
    records = run_training(tmp_path, "tiny-3d.yaml", ["steps=2"], nproc=8)
    coords = {tuple(recs[0]["mesh"][d] for d in ("pp", "dp", "tp")) for recs in records.values()}
    assert coords == set(itertools.product(range(2), repeat=3)), "tp innermost, dp next, pp outermost"
    for rank, recs in records.items():
        assert [r["step"] for r in recs] == [0, 1]
        mesh = recs[0]["mesh"]
        # Rank order on the (pp, dp, tp) mesh: tp varies fastest.
        assert rank == mesh["pp"] * 4 + mesh["dp"] * 2 + mesh["tp"]
        for r in recs:
            assert {"step", "loss", "grad_norm", "lr", "tokens", "step_seconds", "mfu", "phases"} <= r.keys()
            assert {"data_wait", "forward_backward", "dp_reduce", "grad_norm_clip", "optimizer"} <= r["phases"].keys()
            assert r["dp_reduce_enter_ns"] > 0, "each rank records when it entered the dp reduce"
            assert r["mfu"] > 0 and r["peak_source"].startswith("probe:")
