"""Every parallel layout trains the same model as one process: same seed, same batches, same losses.

Each case runs a real torchrun job on gloo and compares its per-step losses with a single
process that holds the whole model and the whole global batch. The 8-rank 3D run's records are
also checked for what each rank says of its place in the mesh (one run for both: ~25 s).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_training

pytestmark = pytest.mark.multiprocess

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


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The torchrun job of a case, run once for every test of this module that reads it."""
    done: dict[str, dict[int, list[dict]]] = {}

    def run(case: str) -> dict[int, list[dict]]:
        if case not in done:
            config, world, extra = CASES[case]
            done[case] = run_training(tmp_path_factory.mktemp(case), config, COMMON + extra, nproc=world)
        return done[case]

    return run


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_layout_matches_a_single_process(case: str, parallel_run: Any, tmp_path: Path) -> None:
    config, world, extra = CASES[case]
    parallel = parallel_run(case)
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


@pytest.mark.timeout(420)
def test_3d_run_records_every_rank_with_its_mesh_coordinates_and_phases(parallel_run: Any) -> None:
    records = parallel_run("pp2-dp2-tp2")
    coords = {tuple(recs[0]["mesh"][d] for d in ("pp", "dp", "tp")) for recs in records.values()}
    assert coords == set(itertools.product(range(2), repeat=3)), "tp innermost, dp next, pp outermost"
    for rank, recs in records.items():
        assert [r["step"] for r in recs] == list(range(STEPS))
        mesh = recs[0]["mesh"]
        # Rank order on the (pp, dp, tp) mesh: tp varies fastest.
        assert rank == mesh["pp"] * 4 + mesh["dp"] * 2 + mesh["tp"]
        for r in recs:
            assert {"step", "loss", "grad_norm", "lr", "tokens", "step_seconds", "mfu", "phases"} <= r.keys()
            assert {"data_wait", "forward_backward", "dp_reduce", "grad_norm_clip", "optimizer"} <= r["phases"].keys()
            assert r["dp_reduce_enter_ns"] > 0, "each rank records when it entered the dp reduce"
            assert r["mfu"] > 0 and r["peak_source"].startswith("probe:")
