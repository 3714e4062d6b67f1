"""A module the step reaches where scan does not look (a plain dict or list attribute, as
TSLSTM keeps its mixers in a list) used only on the step's output ``y`` (a readout head on the
spikes): scan gave its parameters no gradient, silently, where the loop gives them one. The
check for tensors requiring grad that are not in ``params`` walked the new state only; it walks
the outputs too now, and ``params=[...]`` runs as the loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.extra = {"head": nn.Linear(6, 3)}  # a plain dict: not registered
        self.decay = 0.9

    def step(self, mem: Tensor, x: Tensor) -> Any:
        mem = self.decay * mem + self.fc(x)
        spk = torch.sigmoid(mem)
        return mem, self.extra["head"](spk)


def _loop(net: Net, x: Tensor) -> Tensor:
    mem, ys = torch.zeros(x.shape[1], 6), []
    for t in range(x.shape[0]):
        mem, y = net.step(mem, x[t])
        ys.append(y)
    return torch.stack(ys)


@pytest.mark.parametrize("plan", [sc.plans.BPTT(), sc.plans.Uniform(3), sc.plans.Revolve(2)])
def test_a_head_used_on_the_output_only_is_refused_not_left_without_gradient(plan: Any) -> None:
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(8, 2, 6)
    with pytest.raises(sc.UnlistedParamsError, match=r"\(3, 6\)"):
        sc.scan(net.step, x, torch.zeros(2, 6), plan=plan)


def test_passing_the_head_runs_as_the_loop() -> None:
    torch.manual_seed(0)
    net = Net()
    head = net.extra["head"]
    x = torch.randn(8, 2, 6)
    _loop(net, x).pow(2).sum().backward()
    ref = [p.grad.clone() for p in (*net.parameters(), *head.parameters())]
    for p in (*net.parameters(), *head.parameters()):
        p.grad = None
    params = [*net.parameters(), *head.parameters()]
    out, _ = sc.scan(net.step, x, torch.zeros(2, 6), plan=sc.plans.Uniform(3), params=params)
    out.pow(2).sum().backward()
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r)
