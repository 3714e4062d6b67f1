"""A layer of yours that keeps its state on itself and sets it up only when told to
(``forward(xi, init=False)`` reading ``self.v`` unless ``init``: spikingtorch's ``CoarseLIF``,
whose loop calls ``layer(x_t, i == 0)``) is refused at its first step naming the layer, the
attribute and the way forward, as it is once the attribute exists. Before: torch's
``AttributeError: 'CoarseLIF' object has no attribute 'v'`` from inside the user's forward,
which said nothing of spikeckpt calling ``forward(x)`` nor of state kept on the module."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt import plans


class CoarseLIF(nn.Module):
    """Membrane and spikes kept on the module, set up when ``init`` is true."""

    def __init__(self, tau: float = 4.0) -> None:
        super().__init__()
        self.a = math.exp(-1.0 / tau)
        self.b = tau * (1 - self.a)

    def forward(self, xi: Tensor, init: bool = False) -> Tensor:
        if init:
            v, s = torch.zeros_like(xi), torch.zeros_like(xi)
        else:
            v, s = self.v, self.s
        self.v = (1 - s) * (self.a * v + self.b * xi)
        self.s = (self.v > 1.0).to(xi.dtype)
        return self.s


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), CoarseLIF(), nn.Linear(5, 3), CoarseLIF())


@pytest.mark.parametrize("plan", [plans.BPTT(), plans.Uniform(3)])
def test_state_never_set_is_refused_naming_it(plan: object) -> None:
    seq = spikeckpt.wrap(_net(), plan=plan)
    with pytest.raises(spikeckpt.UnsupportedLayerError) as info:
        seq(torch.rand(8, 2, 6))
    msg = str(info.value)
    assert "layer '1'" in msg and "CoarseLIF" in msg
    assert "self.v" in msg and "init" in msg
    assert "forward(x, state) -> (y, state)" in msg


def test_state_set_by_an_earlier_loop_is_refused_too() -> None:
    net = _net()
    x = torch.rand(8, 2, 6)
    with torch.no_grad():
        h = x[0]
        for i, layer in enumerate(net):
            h = layer(h, True) if i % 2 else layer(h)
    with pytest.raises(spikeckpt.UnsupportedLayerError, match=r"self\.s, self\.v"):
        spikeckpt.wrap(net, plan=plans.BPTT())(x)


def test_a_missing_attribute_of_a_plain_stateless_layer_is_its_own_error() -> None:
    class Broken(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x * self.scale  # never set: a bug of the user's, not state

    seq = spikeckpt.wrap(nn.Sequential(nn.Linear(4, 4), Broken()), plan=plans.BPTT())
    with pytest.raises(AttributeError, match="scale"):
        seq(torch.rand(3, 2, 4))
