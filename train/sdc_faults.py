"""Silent data corruption as hardware makes it (tests, chaos): one bit flipped in one element of a matmul's output,
only on one host's ranks, at a rate.

A `MatmulFlip` arms each forward pass of a rank on host `node` (from step `from_step` on) with probability `rate`;
an armed pass flips bit `bit` (by default the top bit of the exponent) of one element, drawn at random, of the first
`nn.Linear` output it computes, and disarms. The top exponent bit turns a value below 2 in magnitude into one near
2^127 (float32) or 2^127 (bfloat16): the layers after it overflow, and the step's loss comes out NaN, infinite or
far too high, as it does when a GPU's arithmetic goes bad. A value of 2 or more loses its magnitude instead: a
corruption nothing notices, which real hardware also makes.

What separates it from a poisoned batch (TrainConfig.inject_bad_sample): the flip follows the host's ranks, whatever
batch they compute, and a second run of the same step need not meet it again (rate < 1).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from wire import rank_env

_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_TOP_EXPONENT_BIT = {torch.float32: 30, torch.bfloat16: 14, torch.float16: 14}
SAID_AT_MOST = 5
"""Flips printed per rank (a rate of 1 flips every pass)."""


@dataclass(kw_only=True, slots=True)
class MatmulFlip:
    node: str
    """The host whose ranks flip (its name as the healer knows it, MEGAHEAL_NODE; else its hostname)."""
    rate: float = 1.0
    """The chance that a forward pass of such a rank flips a bit (0 < rate <= 1)."""
    from_step: int = 0
    """The first step whose passes may flip."""
    bit: int | None = None
    """The bit flipped; None: the top bit of the exponent."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.node:
            raise ValueError("node must name a host")
        if not 0 < self.rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {self.rate}")
        if self.from_step < 0:
            raise ValueError(f"from_step must be >= 0, got {self.from_step}")
        if self.bit is not None and not 0 <= self.bit < 32:
            raise ValueError(f"bit must be in [0, 32), got {self.bit}")


def this_node() -> str:
    return os.environ.get(rank_env.NODE) or socket.gethostname()


class MatmulFlipper:
    """The flips of this rank's host, hooked on every nn.Linear of its chunks; `arm(step)` before each forward pass."""

    def __init__(self, faults: list[MatmulFlip], rank: int, modules: list[nn.Module]) -> None:
        node = this_node()
        self.faults = [f for f in faults if f.node == node]
        self.rank = rank
        self._rng = np.random.default_rng([f.seed for f in self.faults] + [rank])
        self._armed: MatmulFlip | None = None
        self._step = 0
        self.flips = 0
        self._handles: list[RemovableHandle] = []
        if self.faults:
            for module in modules:
                for name, sub in module.named_modules():
                    if isinstance(sub, nn.Linear):
                        self._handles.append(sub.register_forward_hook(self._hook(name)))

    def arm(self, step: int) -> None:
        """Draw whether the coming forward pass flips a bit."""
        self._step = step
        due = [f for f in self.faults if step >= f.from_step]
        self._armed = next((f for f in due if self._rng.random() < f.rate), None)

    def _hook(self, name: str) -> Callable[[nn.Module, object, torch.Tensor], None]:
        def flip(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
            fault = self._armed
            if fault is None:
                return
            local = output.to_local() if isinstance(output, DTensor) else output
            if local.dtype not in _INT_OF or local.numel() == 0:
                return
            self._armed = None
            bit = _TOP_EXPONENT_BIT[local.dtype] if fault.bit is None else fault.bit
            bit = min(bit, torch.finfo(local.dtype).bits - 1)
            index = int(self._rng.integers(local.numel()))
            with torch.no_grad():
                element = local.detach().view(-1)[index:index + 1]
                before = float(element)
                # NOTE: bit 15 of an int16 is its sign: 1 << 15 does not fit, -(1 << 15) is the same bits.
                mask = -(1 << bit) if bit == torch.finfo(local.dtype).bits - 1 else 1 << bit
                element.view(_INT_OF[local.dtype]).bitwise_xor_(mask)
                after = float(element)
            self.flips += 1
            if self.flips <= SAID_AT_MOST:
                print(f"fault injection: rank {self.rank} flipped bit {bit} of element {index} of {name}'s output "
                      f"at step {self._step} ({before:.4g} -> {after:.4g})", flush=True)
        return flip

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@dataclass(kw_only=True, slots=True)
class ParamFlip:
    rank: int
    """The data-parallel rank whose gathered copy of the weights goes bad."""
    at_step: int
    """The step it happens in (once per run)."""
    bit: int = 12
    """The bit flipped; by default a mantissa bit of a float32: a change no NaN or spike check sees."""

    def __post_init__(self) -> None:
        if self.rank < 0 or self.at_step < 0:
            raise ValueError(f"rank and at_step must be >= 0, got {self.rank}, {self.at_step}")
        if not 0 <= self.bit < 32:
            raise ValueError(f"bit must be in [0, 32), got {self.bit}")

    @property
    def mark(self) -> str:
        return f"param-flip-step{self.at_step}-rank{self.rank}.fired"


class ParamFlipper:
    """A bit flipped in one element of a rank's gathered weights (after FSDP's all-gather, before the matmul that
    reads them): memory or a link that corrupted the copy, for one step (the next step gathers afresh). Each fires
    once per run: its rank leaves a mark in the run directory's chaos folder."""

    def __init__(self, faults: list[ParamFlip], rank: int, modules: list[nn.Module], run_dir: Path) -> None:
        self.marks = run_dir / "chaos"
        self.faults = [f for f in faults if f.rank == rank and not (self.marks / f.mark).exists()]
        self.rank = rank
        self._armed: ParamFlip | None = None
        self._step = 0
        self._handle: RemovableHandle | None = None
        first = next((m for c in modules for m in c.modules() if isinstance(m, nn.Linear)), None)
        if self.faults and first is not None:
            self._handle = first.register_forward_pre_hook(self._flip)

    def arm(self, step: int) -> None:
        self._step = step
        self._armed = next((f for f in self.faults if f.at_step == step), None)

    def _flip(self, module: nn.Module, inputs: object) -> None:
        fault = self._armed
        weight = module.weight
        local = (weight.to_local() if isinstance(weight, DTensor) else weight).detach()
        if fault is None or local.dtype not in _INT_OF or local.numel() == 0:
            return
        self._armed = None
        self.faults.remove(fault)
        with torch.no_grad():
            element = local.view(-1)[:1]
            before = float(element)
            element.view(_INT_OF[local.dtype]).bitwise_xor_(1 << min(fault.bit, torch.finfo(local.dtype).bits - 2))
            after = float(element)
        said = (f"rank {self.rank} flipped bit {fault.bit} of its gathered copy of a weight at step {self._step} "
                f"({before:.9g} -> {after:.9g})")
        self.marks.mkdir(parents=True, exist_ok=True)
        (self.marks / fault.mark).write_text(said + "\n")
        print(f"fault injection: {said}", flush=True)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
