"""Tests for train.optim: LAMB against a plain reference, param grouping, lr schedule, config."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from train.optim import LAMB, OptimConfig, build_lr_scheduler, build_optimizer, lr_factor

pytestmark = pytest.mark.unit


def reference_lamb_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state: list[dict[str, torch.Tensor | int]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One LAMB step written out per tensor, straight from the paper's algorithm."""
    beta1, beta2 = betas
    for p, g, s in zip(params, grads, state):
        if not s:
            s["t"] = 0
            s["m"] = torch.zeros_like(p)
            s["v"] = torch.zeros_like(p)
        s["t"] += 1
        s["m"] = beta1 * s["m"] + (1 - beta1) * g
        s["v"] = beta2 * s["v"] + (1 - beta2) * g * g
        m_hat = s["m"] / (1 - beta1 ** s["t"])
        v_hat = s["v"] / (1 - beta2 ** s["t"])
        update = m_hat / (v_hat.sqrt() + eps) + weight_decay * p
        w_norm = p.norm().item()
        u_norm = update.norm().item()
        ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        p -= lr * ratio * update


SHAPES = [(7, 5), (13,), (3, 4, 2), (1,), (6, 6)]


def test_lamb_matches_a_plain_reference_implementation() -> None:
    gen = torch.Generator().manual_seed(1234)
    initial = [torch.randn(shape, generator=gen) for shape in SHAPES]
    initial.append(torch.zeros(4, 3))  # a zero tensor takes the ratio = 1 branch
    steps_grads = [[torch.randn(t.shape, generator=gen) for t in initial] for _ in range(5)]
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)

    ref_params = [t.clone() for t in initial]
    ref_state: list[dict[str, torch.Tensor | int]] = [{} for _ in initial]
    params = [nn.Parameter(t.clone()) for t in initial]
    opt = LAMB(params, **hyper)
    for grads in steps_grads:
        reference_lamb_step(ref_params, grads, ref_state, **hyper)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()

    for p, ref in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), ref, atol=1e-6, rtol=1e-6)
    for p, s in zip(params, ref_state):
        state = opt.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert state["step"].item() == 5
        torch.testing.assert_close(state["exp_avg"], s["m"], atol=1e-6, rtol=1e-6)


def test_lamb_trust_ratio_is_one_for_zero_weights() -> None:
    # With zero weights and no decay, one LAMB step is exactly one Adam step of size lr.
    param = nn.Parameter(torch.zeros(5))
    grad = torch.tensor([1.0, -2.0, 0.5, 3.0, -0.25])
    param.grad = grad.clone()
    opt = LAMB([param], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    opt.step()
    # First bias-corrected Adam step: m_hat = g, v_hat = g^2, so u = sign(g) (up to eps).
    expected = -0.1 * grad / (grad.abs() + 1e-8)
    torch.testing.assert_close(param.detach(), expected)


def test_lamb_skips_params_without_grads() -> None:
    with_grad = nn.Parameter(torch.ones(3))
    without_grad = nn.Parameter(torch.ones(3))
    with_grad.grad = torch.ones(3)
    opt = LAMB([with_grad, without_grad], lr=0.1)
    opt.step()
    assert without_grad not in opt.state
    torch.testing.assert_close(without_grad.detach(), torch.ones(3))
    assert not torch.equal(with_grad.detach(), torch.ones(3))


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Parameter(torch.ones(4, 4), requires_grad=False)


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_weight_decay_skips_vectors(name: str) -> None:
    model = _Tiny()
    opt = build_optimizer(model.named_parameters(), OptimConfig(name=name, weight_decay=0.2))
    assert isinstance(opt, torch.optim.AdamW if name == "adamw" else LAMB)
    decayed, undecayed = opt.param_groups
    assert decayed["weight_decay"] == 0.2
    assert undecayed["weight_decay"] == 0.0
    assert {id(p) for p in decayed["params"]} == {id(model.embed.weight), id(model.proj.weight)}
    assert {id(p) for p in undecayed["params"]} == {
        id(model.proj.bias),
        id(model.norm.weight),
        id(model.norm.bias),
    }


def test_lr_schedule_warms_up_then_decays_to_min() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    param = nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([("w", param)], cfg)
    total = 20
    sched = build_lr_scheduler(opt, cfg, total_steps=total)
    lrs = []
    for _ in range(total + 3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)
    decay = lrs[4:total]
    assert all(a > b for a, b in zip(decay, decay[1:])), "cosine must decrease monotonically"
    assert lrs[total - 1] == pytest.approx(0.1)
    assert lrs[total:] == pytest.approx([0.1] * 3), "lr stays at the floor after the last step"
    assert lr_factor(7, cfg, total) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 15))
    )


def test_lr_schedule_without_warmup_starts_at_peak() -> None:
    cfg = OptimConfig(lr=2.0, warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(0, cfg, 10) == pytest.approx(1.0)
    assert lr_factor(9, cfg, 10) == pytest.approx(0.0)


def test_unknown_optimizer_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="adamw, lamb"):
        OptimConfig(name="sgd")
    cfg = OptimConfig()
    cfg.name = "adagrad"  # mutated after validation, e.g. by a CLI override
    with pytest.raises(ValueError, match="adamw, lamb"):
        build_optimizer([("w", nn.Parameter(torch.zeros(2, 2)))], cfg)


def test_betas_accept_a_yaml_list() -> None:
    cfg = OptimConfig(betas=[0.8, 0.9])  # type: ignore[arg-type]
    assert cfg.betas == (0.8, 0.9)
    assert isinstance(cfg.betas, tuple)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr": 0.0}, "optim.lr"),
        ({"lr": float("nan")}, "optim.lr"),
        ({"betas": (0.9,)}, "optim.betas"),
        ({"betas": (0.9, 1.0)}, r"optim.betas\[1\]"),
        ({"betas": (-0.1, 0.9)}, r"optim.betas\[0\]"),
        ({"eps": 0.0}, "optim.eps"),
        ({"weight_decay": -0.1}, "optim.weight_decay"),
        ({"warmup_steps": -1}, "optim.warmup_steps"),
        ({"min_lr_ratio": 1.5}, "optim.min_lr_ratio"),
        ({"grad_clip": -1.0}, "optim.grad_clip"),
    ],
)
def test_bad_config_values_are_errors(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        OptimConfig(**kwargs)


def test_bad_lamb_arguments_and_total_steps_are_errors() -> None:
    param = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="lr"):
        LAMB([param], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        LAMB([param], betas=(0.9, 1.2))
    opt = LAMB([param])
    with pytest.raises(ValueError, match="total_steps"):
        build_lr_scheduler(opt, OptimConfig(), total_steps=0)


def test_no_trainable_parameters_is_an_error() -> None:
    frozen = nn.Parameter(torch.zeros(2, 2), requires_grad=False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([("w", frozen)], OptimConfig())
