"""The GPT model in one process: every option trains, the window really limits attention, names are layout-free."""

from __future__ import annotations

import pytest
import torch

from train.model import GPT, ModelConfig, count_flop_params, cross_entropy_loss, sliding_window_mask

pytestmark = pytest.mark.unit

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, seq_len=16)


def _model(**options) -> GPT:
    model = GPT(ModelConfig(**{**TINY, **options}))
    model.init_weights(seed=3)
    return model


@pytest.mark.parametrize("parallel_block", [False, True])
@pytest.mark.parametrize("window", [None, 4, 16, 100])
def test_every_model_option_runs_forward_and_backward(parallel_block, window) -> None:
    model = _model(parallel_block=parallel_block, window=window)
    tokens = torch.randint(0, 64, (2, 17))
    logits = model(tokens[:, :-1])
    assert logits.shape == (2, 16, 64)
    loss = cross_entropy_loss(logits, tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_parallel_block_has_one_norm_and_serial_block_two() -> None:
    assert _model(parallel_block=True).layers["0"].ffn_norm is None
    assert _model(parallel_block=False).layers["0"].ffn_norm is not None


def test_sliding_window_mask_allows_only_the_last_w_keys() -> None:
    mask = sliding_window_mask(6, 3, torch.device("cpu"))
    assert mask[5].tolist() == [False, False, False, True, True, True]
    assert mask[1].tolist() == [True, True, False, False, False, False]


@pytest.mark.parametrize("parallel_block", [False, True])
def test_a_token_outside_the_window_does_not_change_the_output(parallel_block) -> None:
    window, layers = 4, 2
    model = _model(window=window, n_layers=layers, parallel_block=parallel_block)
    tokens = torch.randint(0, 64, (1, 16))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    # Each layer looks back window-1 tokens, so after L layers position p sees back to p - L(window-1).
    reach = layers * (window - 1)
    assert torch.equal(a[0, reach + 1 :], b[0, reach + 1 :]), "positions beyond the receptive field are unchanged"
    assert not torch.allclose(a[0, reach], b[0, reach]), "the last position that can see token 0 does change"


def test_without_a_window_every_later_token_sees_the_first() -> None:
    model = _model(window=None)
    tokens = torch.randint(0, 64, (1, 16))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % 64
    with torch.no_grad():
        assert not torch.allclose(model(tokens)[0, -1], model(changed)[0, -1])


def test_a_pipeline_stage_holds_its_layers_under_their_global_names_with_the_same_weights() -> None:
    cfg = ModelConfig(**{**TINY, "n_layers": 4})
    full = GPT(cfg)
    full.init_weights(seed=5)
    stage = GPT(cfg, [2, 3], with_embedding=False, with_head=True)
    stage.init_weights(seed=5)
    full_params = dict(full.named_parameters())
    for name, param in stage.named_parameters():
        assert name in full_params
        assert torch.equal(param, full_params[name]), name
    assert stage.tok_embeddings is None and "layers.0.attention.wq.weight" not in dict(stage.named_parameters())


def test_flop_parameter_count_excludes_only_the_input_embedding() -> None:
    cfg = ModelConfig(**TINY)
    total = sum(p.numel() for p in GPT(cfg).parameters())
    assert count_flop_params(cfg) == total - cfg.vocab_size * cfg.dim


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(dim=30, n_heads=4), "model.dim (30) must be a multiple of model.n_heads (4)"),
        (dict(dim=24, n_heads=8), "must be even for RoPE"),
        (dict(window=0), "model.window must be >= 1"),
        (dict(n_layers=0), "model.n_layers must be >= 1"),
    ],
)
def test_bad_model_config_names_the_field(options, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**{**TINY, **options})
