"""A layer of yours that assigns the same plain value on itself at every call
(``self.batchSize = input.size()[0]``, ``self.shape = x.shape``: the DVS-Gesture LIF-RNN
cells do) is not state kept between calls: it runs at any batch size, with the loop's
results. Before: accepted at batch 3 and refused at batch 300 ("keeps state on itself:
self.batchSize"), as ints above 256 are new objects at each call. A value that changes
(a counter) is still refused."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt import plans


class Cell(nn.Module):
    """LIF-RNN cell returning its state; records its batch size and input shape."""

    def __init__(self, n_in: int, n_hid: int) -> None:
        super().__init__()
        self.rnncell = nn.RNNCell(n_in, n_hid)
        self.batchSize: int | None = None
        self.shape: torch.Size | None = None

    def forward(self, x: Tensor, h: Tensor | None = None) -> tuple[Tensor, Tensor]:
        self.batchSize = x.size()[0]
        self.shape = x.shape
        if h is None:
            h = torch.zeros(self.batchSize, self.rnncell.hidden_size)
        u = self.rnncell(x, h)
        spk = (u > 0.3).to(u.dtype) + u - u.detach()
        return spk, 0.3 * u * (1 - spk.detach())


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls = self.calls + 1
        return x


def _loop(net: nn.Sequential, x: Tensor) -> Tensor:
    hs: list[Tensor | None] = [None] * len(net)
    outs = []
    for t in range(x.shape[0]):
        out = x[t]
        for i, layer in enumerate(net):
            out, hs[i] = layer(out, hs[i])
        outs.append(out)
    return torch.stack(outs)


@pytest.mark.parametrize("batch", [3, 300])
def test_same_plain_value_runs_at_any_batch_size(batch: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(Cell(6, 5), Cell(5, 4))
    x = (torch.rand(7, batch, 6) < 0.5).float()
    ref = _loop(net, x)
    ref.sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    out = spikeckpt.wrap(net, plan=plans.Uniform(3))(x)
    out.sum().backward()
    assert torch.equal(out, ref)
    for p, g in zip(net.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_a_changing_value_is_still_refused() -> None:
    seq = spikeckpt.wrap(nn.Sequential(nn.Linear(4, 4), Counting()), plan=plans.BPTT())
    with pytest.raises(spikeckpt.UnsupportedLayerError, match=r"self\.calls"):
        seq(torch.rand(5, 2, 4))
