"""A parameter's gradient summed in place from its first contribution (`engine.sums`).

Before 2026-11-29 a stack plan's backward held three weight-sized tensors for a `Linear`
weight used at several steps (autograd summed its first two contributions out of place:
the first arrives as a view, ``mm(...).t()``), as the plain loop does: 48.6 MiB for a
`Linear(2048, 2048)`; now two (32.8 MiB), with the same gradients bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc
from spikeckpt import plans
from spikeckpt.engine.sums import plain

snn = pytest.importorskip("snntorch")

N, T, B = 256, 6, 4
WEIGHT = N * N * 4


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(N, N), snn.Leaky(beta=0.9, init_hidden=True))
    with torch.no_grad():
        net[0].weight.mul_(4)
    return net


def _loop(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    net[1].reset_hidden()
    return torch.stack([net(x[t]) for t in range(x.shape[0])]).sum(0)


def _peak(run) -> tuple[int, list[torch.Tensor]]:
    net = _net()
    torch.manual_seed(1)
    x = (torch.rand(T, B, N) < 0.2).float()
    w = torch.randn(N)
    # the allocator's own events: under the "tensors" meter (a dispatch mode, which takes a
    # handle on each storage) autograd never sums in place
    with sc.MemoryMeter("cpu", mode="allocator") as meter:
        (run(net, x) * w).sum().backward()
    return meter.peak_bytes, [p.grad for p in net.parameters()]


@pytest.mark.parametrize("plan", [plans.BPTT(), plans.Uniform(3), plans.Revolve(slots=1)])
def test_stack_plans_sum_a_weight_gradient_in_place(plan):
    loop_peak, loop_grads = _peak(_loop)

    def wrapped(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        return sc.wrap(net, plan=plan, granularity="stack", readout="sum")(x)

    wrapped(_net(), torch.zeros(T, B, N)).sum().backward()  # a first call, not measured
    peak, grads = _peak(wrapped)
    for got, want in zip(grads, loop_grads, strict=True):
        assert torch.equal(got, want)
        assert got.stride() == want.stride()
    # the loop holds the weight's sum, a new contribution and their sum made out of place
    assert peak <= loop_peak - 0.8 * WEIGHT, (peak, loop_peak)


def test_plain_makes_only_a_whole_view_plain():
    base = torch.randn(4, 3)
    whole = base.t()
    made = plain(whole)
    assert made is not None and made._base is None
    assert made.data_ptr() == base.data_ptr() and torch.equal(made, whole)
    part = base[1:]
    assert plain(part) is part  # a slice: its base holds more than it
    assert plain(base) is base
    assert plain(None) is None
    sparse = torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,), check_invariants=True)
    assert plain(sparse) is sparse


@pytest.mark.parametrize("plan", [plans.BPTT(), plans.Uniform(4)])
def test_unused_and_sparse_gradients_stay_the_loops(plan):
    def make() -> nn.Module:
        torch.manual_seed(2)
        net = nn.Sequential(
            nn.Embedding(10, 6, sparse=True),
            snn.Leaky(beta=0.9, init_hidden=True),
            nn.Linear(6, 3),
            snn.Leaky(beta=0.8, init_hidden=True),
        )
        net.unused = nn.Parameter(torch.randn(3, 3))  # never used: .grad stays None
        return net

    x = torch.randint(0, 10, (9, 2))
    ref, net = make(), make()
    for m in ref:
        if isinstance(m, snn.SpikingNeuron):
            m.reset_hidden()
    torch.stack([ref(x[t]) for t in range(9)]).pow(2).sum().backward()
    sc.wrap(net, plan=plan, granularity="stack")(x).pow(2).sum().backward()
    assert net.unused.grad is None and ref.unused.grad is None
    assert net[0].weight.grad.is_sparse and ref[0].weight.grad.is_sparse
    assert torch.equal(net[0].weight.grad.to_dense(), ref[0].weight.grad.to_dense())
    assert torch.equal(net[2].weight.grad, ref[2].weight.grad)
