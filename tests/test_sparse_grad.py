"""``nn.Embedding(sparse=True)`` (token inputs) gives its weight a sparse gradient. Before
2026-11-29 the layer-wise granularity (and ``"auto"``, which picked it) failed in the
backward with torch's "copy_() between dense and sparse Tensors is not implemented" (the
engine copied each parameter's gradient into the parameter's strided layout)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc


@pytest.mark.parametrize("granularity", ["layer", "auto", "stack"])
@pytest.mark.parametrize("held", [False, True])
def test_sparse_embedding_gradient_is_the_loops(granularity, held):
    snn = pytest.importorskip("snntorch")

    def make() -> nn.Sequential:
        torch.manual_seed(3)
        return nn.Sequential(
            nn.Embedding(20, 8, sparse=True),
            snn.Leaky(beta=0.9, init_hidden=True),
            nn.Linear(8, 4),
            snn.Leaky(beta=0.8, init_hidden=True),
        )

    def loop(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        for m in net.modules():
            if isinstance(m, snn.SpikingNeuron):
                m.reset_hidden()
        return torch.stack([net(x[t]) for t in range(x.shape[0])])

    torch.manual_seed(0)
    x = torch.randint(0, 20, (12, 3))
    ref, net = make(), make()
    seq = sc.wrap(net, granularity=granularity)
    if held:  # a gradient held from an earlier call, accumulated into
        loop(ref, x).sum().backward()
        seq(x).sum().backward()
    loop(ref, x).pow(2).sum().backward()
    seq(x).pow(2).sum().backward()
    torch.testing.assert_close(net[0].weight.grad.to_dense(), ref[0].weight.grad.to_dense())
    torch.testing.assert_close(net[2].weight.grad, ref[2].weight.grad)
