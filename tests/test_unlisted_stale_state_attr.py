"""A step that keeps its state on a module as well (``m.state = state; y = m(x);
return m.state, y``, the e-prop ALIF port's ``self.state`` NamedTuple) leaves tensors with a
graph on that attribute after a call (and after the backward pass's recomputation). At the
next call their graphs hide the module's own parameters from the default ``params``; the
refusal now says so, names the attribute and the way forward. Before: "the step uses 3
tensor(s) requiring grad that are not in params ... pass them with params=[...]", about the
module's own ``nn.Parameter``s, without a word of the attribute."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt import plans


class State(NamedTuple):
    v: Tensor
    s: Tensor


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 5) * 0.8)
        self.state: State | None = None

    def forward(self, x: Tensor) -> Tensor:
        assert self.state is not None
        v = 0.9 * self.state.v + x @ self.w - self.state.s.detach()
        s = (v > 0.5).to(v.dtype) + v - v.detach()
        self.state = State(v, s)
        return s


def _run(net: Net, x: Tensor, **kw: object) -> Tensor:
    def step(state: State, x_t: Tensor) -> tuple[State, Tensor]:
        net.state = state
        y = net(x_t)
        assert net.state is not None
        return net.state, y

    z = torch.zeros(x.shape[1], 5)
    ys, _ = spikeckpt.scan(step, x, State(z, z), **kw)
    return ys


def test_stale_state_attribute_is_named() -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.rand(8, 2, 4)
    _run(net, x, plan=plans.Uniform(3)).sum().backward()
    with pytest.raises(spikeckpt.UnlistedParamsError) as info:
        _run(net, x, plan=plans.Uniform(3))
    msg = str(info.value)
    assert "Net.state" in msg and "parameters of the modules the step reaches" in msg
    assert "params=list(" in msg


def test_the_named_ways_forward_run_with_the_loops_gradients() -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.rand(8, 2, 4)
    net.state = State(torch.zeros(2, 5), torch.zeros(2, 5))
    ref = torch.stack([net(x[t]) for t in range(8)])
    ref.sum().backward()
    g = net.w.grad.clone()
    for clear in (True, False):
        net.zero_grad()
        if clear:
            net.state = None
        kw = {} if clear else {"params": list(net.parameters())}
        ys = _run(net, x, plan=plans.Uniform(3), **kw)
        ys.sum().backward()
        assert torch.equal(ys, ref)
        torch.testing.assert_close(net.w.grad, g)
