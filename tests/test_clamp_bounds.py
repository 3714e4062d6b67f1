"""A learnable decay at exactly a clamp bound (``beta`` = 1.0 or 0.0): the fused kernel's
gradient is torch's, which is 0 there for snnTorch's ``beta.clamp(0, 1)``.

Until 2026-11-29 the kernels passed the gradient at the bounds: a `Leaky(learn_beta=True)`
verified at 0.9 and then clamped to 1.0 by the training loop (``beta.data.clamp_(0, 1)``) got
a `beta.grad` of -454 where the loop's is 0, silently; one built at 1.0 failed the kernel's
check and ran per step."""

from __future__ import annotations

import copy

import pytest
import snntorch as snn
import torch
from snn_loops import leaky_loop
from torch import nn

import spikeckpt


def _net(beta: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 16), snn.Leaky(beta=beta, learn_beta=True), nn.Linear(16, 6), snn.Leaky(0.9)
    )


def _synaptic_loop(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The explicit-state loop of ``Linear, Synaptic, Linear, Leaky`` (zeros at t=0)."""
    fc1, syn1, fc2, lif2 = net
    syn = mem1 = torch.zeros(x.shape[1], 16)
    mem2 = torch.zeros(x.shape[1], 6)
    out = []
    for x_t in x:
        spk1, syn, mem1 = syn1(fc1(x_t), syn, mem1)
        spk2, mem2 = lif2(fc2(spk1), mem2)
        out.append(spk2)
    return torch.stack(out)


@pytest.mark.parametrize("bound", [1.0, 0.0])
def test_beta_clamped_onto_a_bound_after_the_first_call(bound: float) -> None:
    x = (torch.rand(30, 4, 12, generator=torch.Generator().manual_seed(1)) < 0.3).float()
    net = _net(0.9)
    seq = spikeckpt.wrap(net, granularity="layer", exact=True, chunk=7)
    seq(x).sum().backward()  # the kernel is checked here, at beta = 0.9
    net.zero_grad()
    with torch.no_grad():
        net[1].beta.fill_(bound + (0.05 if bound else -0.05)).clamp_(0, 1)
    ref = copy.deepcopy(net)
    out = seq(x)
    out.sum().backward()
    ref_out, _ = leaky_loop(ref, x)
    ref_out.sum().backward()
    assert torch.equal(out, ref_out)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    assert ref[1].beta.grad is not None and net[1].beta.grad is not None
    assert float(ref[1].beta.grad) == 0.0
    assert float(net[1].beta.grad) == 0.0
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["alpha", "beta"])
def test_synaptic_decay_built_at_one_runs_fused(which: str) -> None:
    x = (torch.rand(30, 4, 12, generator=torch.Generator().manual_seed(2)) < 0.3).float()
    torch.manual_seed(0)
    decays = {"alpha": 0.7, "beta": 0.8, which: 1.0}
    net = nn.Sequential(
        nn.Linear(12, 16),
        snn.Synaptic(learn_alpha=True, learn_beta=True, **decays),
        nn.Linear(16, 6),
        snn.Leaky(0.9),
    )
    ref = copy.deepcopy(net)
    seq = spikeckpt.wrap(net, granularity="layer", exact=True, chunk=7)
    out = seq(x)
    out.sum().backward()
    ref_out = _synaptic_loop(ref, x)
    ref_out.sum().backward()
    assert torch.equal(out, ref_out)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    assert float(getattr(ref[1], which).grad) == 0.0
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
