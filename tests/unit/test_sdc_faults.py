"""The hardware-shaped corruption of train/sdc_faults.py: one bit of one element of a matmul's output, only on the
named host's ranks, at a rate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from train.sdc_faults import MatmulFlip, MatmulFlipper

pytestmark = pytest.mark.unit


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


@pytest.mark.parametrize("dtype, bits", [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)])
def test_an_armed_pass_flips_the_top_exponent_bit_of_one_element_of_the_first_matmul_output(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, bits: torch.dtype) -> None:
    monkeypatch.setenv("MEGAHEAL_NODE", "n2")
    m = model().to(dtype)
    x = torch.randn(3, 8, dtype=dtype)
    clean = m[0](x)
    flipper = MatmulFlipper([MatmulFlip(node="n2", rate=1.0)], rank=2, modules=[m])
    seen: list[torch.Tensor] = []
    m[0].register_forward_hook(lambda mod, i, out: seen.append(out.detach().clone()))  # runs after the flip's
    flipper.arm(0)
    m(x)
    changed = (seen[0].view(bits) != clean.view(bits)).nonzero()
    assert len(changed) == 1 and flipper.flips == 1
    top = 30 if dtype == torch.float32 else 14
    i, j = changed[0].tolist()
    assert int(seen[0].view(bits)[i, j]) ^ int(clean.view(bits)[i, j]) == 1 << top
    m(x)  # disarmed after one flip: the next pass is clean until armed again
    assert torch.equal(seen[1], clean) and flipper.flips == 1
    flipper.close()


def test_only_the_named_hosts_ranks_flip_and_not_before_their_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGAHEAL_NODE", "n1")
    m = model()
    assert MatmulFlipper([MatmulFlip(node="n2")], rank=0, modules=[m]).faults == []
    monkeypatch.setenv("MEGAHEAL_NODE", "n2")
    flipper = MatmulFlipper([MatmulFlip(node="n2", from_step=5)], rank=2, modules=[m])
    flipper.arm(4)
    m(torch.randn(2, 8))
    assert flipper.flips == 0
    flipper.arm(5)
    m(torch.randn(2, 8))
    assert flipper.flips == 1


@pytest.mark.parametrize("kw, message", [({"node": ""}, "node must name a host"), ({"rate": 0}, "rate must be in"),
                                         ({"from_step": -1}, "from_step must be >= 0"), ({"bit": 40}, "bit must be")])
def test_a_bad_flip_is_refused_naming_its_field(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MatmulFlip(**{"node": "n2", **kw})  # type: ignore[arg-type]
