"""Optimizers and learning-rate schedules for the trainer.

Two optimizers are offered: torch's AdamW (the default) and LAMB (You et al. 2019,
"Large Batch Optimization for Deep Learning"), whose per-tensor trust ratio keeps
very large global batches stable. Both share one parameter grouping rule: matrices
and embeddings get weight decay, vectors (norm gains, biases) do not, because
decaying a gain pulls it towards zero rather than towards a simpler model.

LAMB works on plain tensors and on DTensors sharded by FSDP2 or tensor parallelism.
Its trust ratio is computed from the norm of the whole logical tensor, so a sharded
run takes exactly the same steps as a single-process one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from inprocess import waits

__all__ = [
    "LAMB",
    "OPTIMIZER_NAMES",
    "OptimConfig",
    "build_lr_scheduler",
    "build_optimizer",
]

OPTIMIZER_NAMES: tuple[str, ...] = ("adamw", "lamb")
"""Values accepted by ``OptimConfig.name``."""


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Optimizer, learning-rate schedule and gradient clipping settings."""

    name: str = "adamw"
    """Which optimizer to build: "adamw" or "lamb"."""

    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""

    betas: tuple[float, float] = (0.9, 0.95)
    """Decay rates of the first and second moment estimates; each in [0, 1)."""

    eps: float = 1e-8
    """Added to the root of the second moment so the update never divides by zero."""

    weight_decay: float = 0.1
    """Decoupled weight decay for matrices and embeddings (vectors get none)."""

    warmup_steps: int = 10
    """Optimizer steps of linear warmup before the cosine decay starts; 0 disables warmup."""

    min_lr_ratio: float = 0.1
    """The cosine decay ends at lr * min_lr_ratio on the last step; in [0, 1]."""

    grad_clip: float = 1.0
    """Maximum global gradient norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        # YAML has no tuples, so betas usually arrive as a 2-item list.
        if isinstance(self.betas, (list, tuple)) and len(self.betas) == 2:
            self.betas = (float(self.betas[0]), float(self.betas[1]))
        else:
            raise ValueError(
                f"optim.betas must be a pair of two numbers such as [0.9, 0.95], got {self.betas!r}"
            )
        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(
                f"optim.name must be one of {', '.join(OPTIMIZER_NAMES)}, got {self.name!r}"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"optim.lr must be a positive finite number, got {self.lr}")
        for index, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"optim.betas[{index}] must be in [0, 1), got {beta}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"optim.eps must be a positive finite number, got {self.eps}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(
                f"optim.weight_decay must be a finite number >= 0, got {self.weight_decay}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(
                f"optim.grad_clip must be a finite number >= 0 (0 disables clipping), "
                f"got {self.grad_clip}"
            )


def _full_norms(tensors: list[Tensor]) -> list[Tensor]:
    """L2 norm of each whole logical tensor, as a plain 0-dim tensor on every rank.

    A sharded DTensor's norm needs the shards' squared norms summed over the mesh dims it is
    sharded on. Tensors are grouped by (mesh, sharded dims) and each group's squares are summed
    with one all-reduce per dim, rather than one collective per tensor (hundreds per step).
    """
    local = torch._foreach_norm([t.to_local() if isinstance(t, DTensor) else t for t in tensors])
    norms: list[Tensor | None] = list(local)
    groups: dict[tuple[object, tuple[int, ...]], list[int]] = {}
    for index, tensor in enumerate(tensors):
        if isinstance(tensor, DTensor):
            dims = tuple(d for d, placement in enumerate(tensor.placements) if placement.is_shard())
            if dims:
                groups.setdefault((tensor.device_mesh, dims), []).append(index)
    # NOTE: every rank of a mesh group holds the same parameters in the same order, so the
    # groups and their collectives come in the same order on every rank.
    for (mesh, dims), indices in groups.items():
        squares = torch.stack([local[i].float() ** 2 for i in indices])
        for dim in dims:
            group = mesh.get_group(dim)  # type: ignore[attr-defined]
            waits.wait_collective(dist.all_reduce(squares, group=group, async_op=True), "a trust ratio's norms")
        for i, norm in zip(indices, squares.sqrt().unbind(0)):
            norms[i] = norm
    return [n for n in norms if n is not None]


def _trust_ratios(weight_norms: list[Tensor], update_norms: list[Tensor]) -> list[Tensor]:
    """Per-tensor ||p|| / ||u||, or 1 where either norm is zero (You et al. 2019)."""
    ratios: list[Tensor | None] = [None] * len(weight_norms)
    # torch.stack needs one device; bucketing keeps a single small kernel per device
    # instead of a handful of launches per parameter.
    by_device: dict[torch.device, list[int]] = {}
    for index, norm in enumerate(weight_norms):
        by_device.setdefault(norm.device, []).append(index)
    for indices in by_device.values():
        # fp32 so bf16 parameters do not get a coarsely rounded ratio.
        w = torch.stack([weight_norms[i] for i in indices]).float()
        u = torch.stack([update_norms[i] for i in indices]).float()
        usable = (w > 0) & (u > 0)
        # Dividing where u == 0 would make inf/nan that torch.where then discards; the
        # ones_like denominator avoids producing them at all.
        ones = torch.ones_like(w)
        ratio = torch.where(usable, w / torch.where(usable, u, ones), ones)
        for i, r in zip(indices, ratio.unbind(0)):
            ratios[i] = r
    return [r for r in ratios if r is not None]


class LAMB(torch.optim.Optimizer):
    """Layer-wise Adaptive Moments for Batch training (You et al. 2019).

    Per parameter: Adam moments ``m``, ``v`` with optional bias correction, update
    ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p``, trust ratio
    ``r = ||p|| / ||u||`` (1 when either norm is 0), then ``p -= lr * r * u``.
    State keys match torch's Adam ("step", "exp_avg", "exp_avg_sq") so distributed
    checkpointing treats both the same way.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, object]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
    ) -> None:
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"LAMB lr must be a finite number >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"LAMB betas must be two numbers in [0, 1), got {betas!r}")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"LAMB eps must be a finite number >= 0, got {eps}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"LAMB weight_decay must be a finite number >= 0, got {weight_decay}")
        defaults = dict(
            lr=lr,
            betas=(float(betas[0]), float(betas[1])),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)

    def _collect(
        self, group: dict[str, object]
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
        """Params that have grads, with their grads and (lazily created) state."""
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        steps: list[Tensor] = []
        for p in group["params"]:  # type: ignore[attr-defined]
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("LAMB does not support sparse gradients")
            state = self.state[p]
            if not state:
                # A CPU float step like torch's Adam: reading it for bias correction
                # then never forces a device synchronisation.
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return params, grads, exp_avgs, exp_avg_sqs, steps

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        """Take one LAMB step over every param group; returns the closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = self._collect(group)
            if params:
                self._update_group(group, params, grads, exp_avgs, exp_avg_sqs, steps)
        return loss

    @staticmethod
    def _update_group(
        group: dict[str, object],
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        steps: list[Tensor],
    ) -> None:
        """The foreach LAMB update of one param group."""
        beta1, beta2 = group["betas"]  # type: ignore[misc]
        lr = float(group["lr"])  # type: ignore[arg-type]
        eps = float(group["eps"])  # type: ignore[arg-type]
        weight_decay = float(group["weight_decay"])  # type: ignore[arg-type]

        torch._foreach_add_(steps, 1.0)
        # m = beta1 * m + (1 - beta1) * g ; v = beta2 * v + (1 - beta2) * g^2
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        if group["bias_correction"]:
            counts = [float(s.item()) for s in steps]
            correction1 = [1.0 - beta1**n for n in counts]
            root_correction2 = [math.sqrt(1.0 - beta2**n) for n in counts]
        else:
            correction1 = [1.0] * len(params)
            root_correction2 = [1.0] * len(params)

        # sqrt(v_hat) + eps = sqrt(v) / sqrt(1 - beta2^t) + eps
        updates = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(updates, root_correction2)
        torch._foreach_add_(updates, eps)
        # u = m_hat / (sqrt(v_hat) + eps), reusing the denominator's buffers.
        torch._foreach_reciprocal_(updates)
        torch._foreach_mul_(updates, exp_avgs)
        torch._foreach_div_(updates, correction1)
        if weight_decay != 0.0:
            torch._foreach_add_(updates, params, alpha=weight_decay)

        ratios = _trust_ratios(_full_norms(params), _full_norms(updates))
        # 0-dim ratio tensors are replicated implicitly when the updates are DTensors.
        torch._foreach_mul_(updates, ratios)
        torch._foreach_add_(params, updates, alpha=-lr)


def _split_by_decay(
    model_params: Iterable[tuple[str, nn.Parameter]],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, not decayed): matrices/embeddings decay, vectors and scalars do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _name, param in model_params:
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    return decay, no_decay


def build_optimizer(
    model_params: Iterable[tuple[str, nn.Parameter]], cfg: OptimConfig
) -> torch.optim.Optimizer:
    """Build the configured optimizer over ``model.named_parameters()``.

    Group 0 holds parameters with ndim >= 2 and uses ``cfg.weight_decay``; group 1
    holds the rest with no decay. Empty groups are left out.
    """
    if cfg.name not in OPTIMIZER_NAMES:
        raise ValueError(
            f"optim.name must be one of {', '.join(OPTIMIZER_NAMES)}, got {cfg.name!r}"
        )
    decay, no_decay = _split_by_decay(model_params)
    groups = [
        {"params": params, "weight_decay": wd}
        for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
        if params
    ]
    if not groups:
        raise ValueError("build_optimizer got no trainable parameters; check the model")
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=True,
        )
    return LAMB(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for the optimizer step with 0-based index ``step``.

    Warmup: ``(step + 1) / warmup_steps`` so the first step already moves the weights.
    Then a cosine from 1 at step ``warmup_steps`` to ``min_lr_ratio`` at the last step
    ``total_steps - 1``, held there afterwards. If ``total_steps <= warmup_steps`` the
    run ends during warmup.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_lr_scheduler(
    opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup then cosine decay to ``cfg.lr * cfg.min_lr_ratio`` at the last step."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}; set the run's step count")
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg, total_steps))
