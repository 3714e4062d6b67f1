"""Modules of yours with a parametrization (``torch.nn.utils.parametrize``): torch swaps their
class for ``Parametrized<Yours>``, defined in torch's own module; they are still yours, stepped
as your neurons and layers (before, "no adapter knows this layer type"). And a neuron
``forward(x, v=None, a=None)`` whose ``initial_state`` returns ``(v, a)`` is refused naming
``forward(x, v, a)`` (before: the TypeError its body raised on the tuple)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch import Tensor, nn

import spikeckpt
from spikeckpt import plans


class _Sigmoid(nn.Module):
    def forward(self, raw: Tensor) -> Tensor:
        return torch.sigmoid(raw)


class LeakyIntegrator(nn.Module):
    """A non-spiking readout with a learnable leak kept raw and squashed by a parametrization."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.linspace(-1.0, 1.0, n))
        parametrize.register_parametrization(self, "beta", _Sigmoid())

    def forward(self, x: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:
        mem = self.beta * mem + (1 - self.beta) * x
        return mem, mem


class Gain(nn.Module):
    """A stateless layer of yours with a parametrized gain."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.linspace(-0.5, 0.5, n))
        parametrize.register_parametrization(self, "g", _Sigmoid())

    def forward(self, x: Tensor) -> Tensor:
        return x * (1 + self.g)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), Gain(5), nn.Tanh(), nn.Linear(5, 3), LeakyIntegrator(3))


def _loop(net: nn.Sequential, x: Tensor) -> Tensor:
    fc1, gain, act, fc2, li = net
    mem, out = torch.zeros(x.shape[1], 3), []
    for t in range(x.shape[0]):
        y, mem = li(fc2(act(gain(fc1(x[t])))), mem)
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize(
    "kw",
    [
        {"plan": plans.BPTT()},
        {"plan": plans.Revolve(2)},
        {"plan": plans.Uniform(3), "granularity": "layer"},
    ],
    ids=["bptt", "revolve", "layer"],
)
def test_parametrized_modules_of_yours_step_as_the_loop(kw: dict) -> None:
    net = _net()
    ref = copy.deepcopy(net)
    x = torch.randn(7, 4, 6)
    want = _loop(ref, x)
    want.max(0).values.sum().backward()
    got = spikeckpt.wrap(net, **kw)(x)
    got.max(0).values.sum().backward()
    torch.testing.assert_close(got, want)
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert net[4].parametrizations.beta.original.grad.abs().sum() > 0


class TwoOptionalStates(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def initial_state(self, x: Tensor) -> tuple[Tensor, Tensor]:
        z = x.new_zeros(x.shape[0], self.n)
        return z, z.clone()

    def forward(
        self, x: Tensor, v: Tensor | None = None, a: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        if v is None:  # as the loop calls it: both None at t=0
            v, a = self.initial_state(x)
        v = 0.9 * v + x - 0.5 * a
        spk = (v > 1).float()
        return spk, v, 0.8 * a + spk


def test_optional_states_with_a_tuple_initial_state_are_refused_naming_the_fix() -> None:
    net = nn.Sequential(nn.Linear(4, 3), TwoOptionalStates(3))
    with pytest.raises(spikeckpt.UnsupportedLayerError, match=r"forward\(x, v, a\)") as info:
        spikeckpt.wrap(net, plan=plans.BPTT())(torch.randn(5, 2, 4))
    assert "layer '1'" in str(info.value)
