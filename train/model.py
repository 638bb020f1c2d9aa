"""GPT decoder with MegaScale's model options: parallel block and sliding-window attention.

Layers live in a ModuleDict keyed by their *global* index, so parameter names
(`layers.7.attention.wq.weight`) are the same whatever pipeline stage holds them; that is what
lets a checkpoint saved at one layout load at another. A pipeline stage is the same class with
only some layers and, where it is not the first or last stage, no embedding or head.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    vocab_size: int = 256
    """Token vocabulary; byte-level text needs at least 256."""
    dim: int = 128
    """Hidden size h."""
    n_layers: int = 4
    """Transformer blocks L."""
    n_heads: int = 4
    """Attention heads; dim must divide by it."""
    ffn_dim: int = 512
    """Inner size of the SwiGLU MLP."""
    seq_len: int = 128
    """Tokens per sample."""
    window: int | None = None
    """Sliding-window attention: a token attends to itself and the window-1 before it. None: full causal."""
    parallel_block: bool = False
    """MegaScale's parallel block: attention and MLP read one normalised input and are summed."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be a multiple of model.n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"model.dim / model.n_heads = {self.dim // self.n_heads} must be even for RoPE")
        if self.window is not None and self.window < 1:
            raise ValueError(f"model.window must be >= 1 or null, got {self.window}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def effective_window(self) -> int:
        """Keys a query sees at most: s_eff in the MFU formula."""
        return self.seq_len if self.window is None else min(self.window, self.seq_len)


# ---------------------------------------------------------------- attention


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary position angles, shaped [seq_len, 1, head_dim/2] to broadcast over heads."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by their position's angle; x is [B, T, H, D]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def sliding_window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean [T, T] mask, True where query i may attend key j: j <= i and i - j < window."""
    pos = torch.arange(seq_len, device=device)
    distance = pos[:, None] - pos[None, :]
    return (distance >= 0) & (distance < window)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        # NOTE: view(B, T, -1, hd), not n_heads: under tensor parallelism each rank holds n_heads/tp heads.
        q, k, v = (w(x).view(B, T, -1, hd) for w in (self.wq, self.wk, self.wv))
        cos, sin = rope_tables(T, hd, self.cfg.rope_theta, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        window = self.cfg.window
        if window is None or window >= T:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=sliding_window_mask(T, window, x.device))
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.parallel = cfg.parallel_block
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        # The parallel block has one norm feeding both branches; the serial block one per branch.
        self.ffn_norm = None if cfg.parallel_block else nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            normed = self.attention_norm(x)
            return x + self.attention(normed) + self.feed_forward(normed)
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


# ---------------------------------------------------------------- the model


class GPT(nn.Module):
    """A decoder, or the slice of one a pipeline stage holds.

    `layer_ids` selects the global layers this instance owns (default: all);
    `with_embedding` / `with_head` say whether it is the first / last stage.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_ids: Iterable[int] | None = None,
        *,
        with_embedding: bool = True,
        with_head: bool = True,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        ids = range(cfg.n_layers) if layer_ids is None else list(layer_ids)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if with_embedding else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in ids})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps) if with_head else None
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if with_head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.output is None:
            return h
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from a generator seeded by (seed, its name).

        Seeding by name makes a parameter's initial value independent of which stage or
        rank builds it, so every parallel layout starts from the same model.
        """
        depth_scale = 1.0 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            # Residual-branch output projections are scaled down with depth (GPT-2 init).
            std = self.cfg.init_std * (depth_scale if name.endswith(("wo.weight", "w2.weight")) else 1.0)
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            param.copy_(values.to(param.device, param.dtype))


def count_flop_params(cfg: ModelConfig) -> int:
    """Parameters whose matmuls cost FLOPs: all but the input embedding table (a lookup).

    The output head is counted: its matmul is real work on every token.
    """
    with torch.device("meta"):
        model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    return total - model.tok_embeddings.weight.numel()


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over every token of the (micro)batch, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
