"""A layer built with ``inplace=True`` right after a neuron whose output is its state
(``nn.GRUCell``'s ``h``): the plain loop's in-place op changes the cell's state too. The stack
runs it as the loop does; before 2026-11-29 the layer-wise granularity handed the layer a copy
and its spikes differed from the loop's (5-16 of 90), silently. Now layer-wise refuses it,
naming the layer, the cell and the ways forward, and ``granularity="auto"`` runs the stack."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc

snn = pytest.importorskip("snntorch")


def _net(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    act = nn.Dropout(0.3, inplace=True) if kind == "dropout" else nn.ReLU(inplace=True)
    return nn.Sequential(nn.Linear(6, 6), nn.GRUCell(6, 8), act, nn.Linear(8, 3), snn.Leaky(0.9))


def _loop(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The user's loop: the in-place layer changes ``h``, the cell's state."""
    h, mem, out = None, net[4].init_leaky(), []
    for x_t in x:
        h = net[1](net[0](x_t), h)
        spk, mem = net[4](net[3](net[2](h)), mem)
        out.append(spk)
    return torch.stack(out)


@pytest.mark.parametrize("kind", ["dropout", "relu"])
def test_layerwise_refuses_it(kind: str) -> None:
    x = torch.randn(10, 3, 6) * 3
    with pytest.raises(sc.UnsupportedLayerError, match=r"'2'.*in place.*'1'.*inplace=False"):
        sc.wrap(_net(kind), plan=sc.plans.Uniform(3), granularity="layer")(x)


@pytest.mark.parametrize("kind", ["dropout", "relu"])
@pytest.mark.parametrize("granularity", ["stack", "auto"])
def test_stack_and_auto_give_the_loops_spikes(kind: str, granularity: str) -> None:
    x = torch.randn(10, 3, 6, generator=torch.Generator().manual_seed(2)) * 3
    torch.manual_seed(1)
    expected = _loop(_net(kind), x)
    torch.manual_seed(1)
    out = sc.wrap(_net(kind), plan=sc.plans.Uniform(3), granularity=granularity)(x)
    assert torch.equal(out, expected)
