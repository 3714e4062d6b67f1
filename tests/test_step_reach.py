"""What `scan` finds reachable from a step (`spikeckpt.engine.step.reachable`): the globals its
code loads, not every name in its code (attribute names too: ``self.out`` named a
module-level ``out``, the previous call's result, whose outputs joined the next call's
parameters; its backward then reached the previous call's freed graph)."""

from __future__ import annotations

from typing import Any

import snntorch as snn
import torch
from torch import nn

import spikeckpt as sc
from spikeckpt.engine.step import reachable

#: a training loop's result at module level, as a script keeps it (``out = scan(...)``)
out: Any = None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.lif = snn.Leaky(beta=0.9)
        self.out = nn.Linear(6, 3)  # the attribute shares the global's name

    def step(self, state: Any, x_t: torch.Tensor) -> tuple[Any, torch.Tensor]:
        spk, mem = self.lif(self.fc(x_t), state)
        return mem, self.out(spk)


def test_a_previous_result_named_like_an_attribute_is_not_reached() -> None:
    global out
    torch.manual_seed(0)
    net = Net()
    x = torch.rand(12, 2, 4) * 2
    for _ in range(3):  # each step's backward after the last result was kept
        net.zero_grad()
        out = sc.scan(net.step, x, torch.zeros(2, 6), plan=sc.plans.Uniform(4))
        out.ys.sum().backward()
    found, _ = reachable(net.step)
    assert {id(t) for t in found} == {id(p) for p in net.parameters()}
    out = None
