"""Layout validation: every constraint between degrees, world size, model and batch has its own message."""

from __future__ import annotations

import re

import pytest

from train.layout import LayoutError, ParallelConfig, stage_ids, stage_layers, validate_layout
from train.model import ModelConfig

pytestmark = pytest.mark.unit

MODEL = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, ffn_dim=256, seq_len=64)


def _check(par: dict, world: int, batch: int = 8, model: ModelConfig = MODEL) -> None:
    validate_layout(ParallelConfig(**par), model, batch, world)


@pytest.mark.parametrize(
    ("par", "world", "batch", "model", "message"),
    [
        (dict(dp=4), 8, 8, MODEL, "pp x dp x tp = 1 x 4 x 1 = 4, but the job has 8 processes"),
        (dict(dp=3), 3, 8, MODEL, "global_batch (8) must be a multiple of parallel.dp (3)"),
        (dict(dp=2, microbatches=3), 2, 8, MODEL, "global_batch / dp = 4) must be a multiple of parallel.microbatches (3)"),
        (dict(virtual_stages=2, schedule="interleaved-1f1b"), 1, 8, MODEL, "virtual_stages > 1 needs parallel.pp > 1"),
        (dict(pp=2, virtual_stages=2, microbatches=2), 2, 8, MODEL, "needs schedule interleaved-1f1b (got 1f1b)"),
        (dict(pp=2, virtual_stages=4, schedule="interleaved-1f1b", microbatches=4), 2, 8, MODEL,
         "model.n_layers (4) must be a multiple of the pipeline stages pp x virtual_stages = 2 x 4 = 8"),
        (dict(pp=2, microbatches=1), 2, 8, MODEL, "parallel.microbatches (1) must be >= parallel.pp (2)"),
        (dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=5), 2, 10, MODEL,
         "use a multiple of pp (2)"),
        (dict(tp=3), 3, 8, ModelConfig(n_heads=4, dim=96, ffn_dim=192, vocab_size=258, seq_len=66),
         "model.n_heads (4) must be a multiple of parallel.tp (3)"),
        (dict(tp=2), 2, 8, ModelConfig(n_heads=4, dim=64, ffn_dim=255, seq_len=64), "model.ffn_dim (255) must be a multiple"),
        (dict(tp=2), 2, 8, ModelConfig(n_heads=4, dim=64, vocab_size=257, seq_len=64), "model.vocab_size (257)"),
        (dict(tp=2), 2, 8, ModelConfig(n_heads=4, dim=64, seq_len=63), "model.seq_len (63) must be a multiple of parallel.tp (2) with sequence_parallel"),
    ],
)
def test_each_layout_error_says_what_to_change(par, world, batch, model, message) -> None:
    with pytest.raises(LayoutError, match=re.escape(message)):
        _check(par, world, batch, model)


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(LayoutError) as info:
        _check(dict(dp=3, tp=3), 4)
    text = str(info.value)
    assert "but the job has 4 processes" in text and "multiple of parallel.dp (3)" in text


def test_sequence_parallel_off_lifts_the_seq_len_constraint() -> None:
    _check(dict(tp=2, sequence_parallel=False), 2, model=ModelConfig(n_heads=4, dim=64, seq_len=63))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("pp", 0, "parallel.pp must be >= 1"), ("schedule", "zb", "parallel.schedule must be one of")],
)
def test_bad_parallel_values_are_errors(field, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**{field: value})


def test_interleaved_stages_go_round_robin_and_layers_split_evenly() -> None:
    par = ParallelConfig(pp=2, virtual_stages=2, schedule="interleaved-1f1b", microbatches=2)
    assert stage_ids(0, par) == [0, 2] and stage_ids(1, par) == [1, 3]
    assert [list(stage_layers(s, par, 8)) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
