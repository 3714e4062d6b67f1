"""Random draws in the backward pass (snnTorch's ``SSO`` surrogate adds uniform noise to its
gradient): the backward's draws are one stream from the generators' state at its start, as in
the plain loop's backward, whatever the recomputation restores in between, and the generators
end where the loop's do (before: put back where they were, so with no other draws every
training step drew the same noise)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.plans import BPTT, Double, Revolve, Uniform

snn = pytest.importorskip("snntorch")
surrogate = pytest.importorskip("snntorch.surrogate")
snn_utils = pytest.importorskip("snntorch.utils")

PLANS = {
    "bptt": lambda: BPTT(),
    "uniform": lambda: Uniform(3),
    "revolve": lambda: Revolve(2),
    "double": lambda: Double(local_interval=2, remote_interval=4),
}


def _net(dropout: bool) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Linear(6, 8),
        snn.Leaky(beta=0.9, init_hidden=True, spike_grad=surrogate.SSO()),
    ]
    if dropout:  # forward draws too: recomputation restores the generators
        layers.append(nn.Dropout(0.3))
    layers += [nn.Linear(8, 3), snn.Leaky(beta=0.8, init_hidden=True, spike_grad=surrogate.SSO())]
    net = nn.Sequential(*layers)
    with torch.no_grad():
        net[0].weight.mul_(2)
    return net


def _loop(net: nn.Module, x: Tensor) -> Tensor:
    snn_utils.reset(net)
    return torch.stack([net(x[t]) for t in range(x.shape[0])])


def _step(net: nn.Module, run: Any, x: Tensor) -> tuple[list[Tensor], Tensor]:
    """Forward from seed 1, backward from seed 2: the parameter gradients and the next draw."""
    torch.manual_seed(1)
    y = run(net, x)
    torch.manual_seed(2)
    y.sum().backward()
    return [p.grad.clone() for p in net.parameters()], torch.rand(4)


@settings(max_examples=12, deadline=None)
@given(
    T=st.integers(1, 11),
    plan=st.sampled_from(list(PLANS)),
    dropout=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_backward_draws_are_the_loops(T: int, plan: str, dropout: bool, seed: int) -> None:
    torch.manual_seed(seed)
    net = _net(dropout)
    x = (torch.rand(T, 2, 6) < 0.5).float()
    ref_grads, ref_next = _step(copy.deepcopy(net), _loop, x)
    wrapped = lambda m, x: sc.wrap(m, plan=PLANS[plan]())(x)  # noqa: E731
    grads, after = _step(net, wrapped, x)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, r)
    assert torch.equal(after, ref_next)  # the generators end where the loop's do


def test_two_steps_draw_other_noise() -> None:
    """With no other draws between them, two training steps got the same backward noise."""
    net = _net(dropout=False)
    seq = sc.wrap(net, plan=Uniform(3))
    x = (torch.rand(7, 2, 6) < 0.5).float()
    torch.manual_seed(0)
    grads = []
    for _ in range(2):
        net.zero_grad()
        seq(x).sum().backward()
        grads.append(net[0].weight.grad.clone())
    assert not torch.equal(grads[0], grads[1])


def test_one_layer_drawing_layer_wise_is_the_loops() -> None:
    """Layer-wise, the backward runs block by block: with one block drawing, its draws are
    the loop's (with two, they come in another order, as Dropout's masks do)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(6, 8),
        snn.Leaky(beta=0.9, init_hidden=True, spike_grad=surrogate.SSO()),
        nn.Linear(8, 3),
        snn.Leaky(beta=0.8, init_hidden=True),
    )
    x = (torch.rand(9, 2, 6) < 0.5).float()
    ref_grads, ref_next = _step(copy.deepcopy(net), _loop, x)
    layered = lambda m, x: sc.wrap(m, granularity="layer", chunk=4)(x)  # noqa: E731
    grads, after = _step(net, layered, x)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    assert torch.equal(after, ref_next)
