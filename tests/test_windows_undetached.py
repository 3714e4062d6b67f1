"""Windows of a long sequence with the state passed on undetached (helper h40): a backward
per window reaches the previous window's run a second time, refused with a message naming
that case and both ways forward; adding the windows' losses and one backward equals the
plain loop's retain_graph=True backwards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt
from spikeckpt.errors import UsageError

snn = pytest.importorskip("snntorch")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), snn.Leaky(0.9), nn.Linear(8, 3), snn.Leaky(0.8))


def _loop_grads(x: torch.Tensor, split: int) -> list[torch.Tensor]:
    net = _net()
    fc1, lif1, fc2, lif2 = net
    mem1, mem2 = lif1.init_leaky(), lif2.init_leaky()
    for part in (x[:split], x[split:]):
        out = []
        for t in range(part.shape[0]):
            spk1, mem1 = lif1(fc1(part[t]), mem1)
            spk2, mem2 = lif2(fc2(spk1), mem2)
            out.append(spk2 * mem2)
        torch.stack(out).sum().backward(retain_graph=True)  # state not detached
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_backward_per_window_through_an_undetached_state_names_the_way(granularity: str) -> None:
    x = torch.rand(14, 2, 6) * 2
    seq = spikeckpt.wrap(
        _net(), plan=spikeckpt.plans.Uniform(3), granularity=granularity, output="both"
    )
    y1, state = seq(x[:8], return_state=True)
    (y1[0] * y1[1]).sum().backward(retain_graph=True)
    y2, state = seq(x[8:], state=state, return_state=True)
    with pytest.raises(UsageError, match=r"undetached as the next call's state=.*detach it"):
        (y2[0] * y2[1]).sum().backward()


@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_one_backward_of_the_windows_losses_equals_the_loop(granularity: str) -> None:
    x = torch.rand(14, 2, 6) * 2
    expected = _loop_grads(x, 8)
    net = _net()
    seq = spikeckpt.wrap(
        net, plan=spikeckpt.plans.Uniform(3), granularity=granularity, output="both"
    )
    y1, state = seq(x[:8], return_state=True)
    y2, _ = seq(x[8:], state=state, return_state=True)
    ((y1[0] * y1[1]).sum() + (y2[0] * y2[1]).sum()).backward()
    for p, g in zip(net.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)
