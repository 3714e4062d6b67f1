"""The error for a scan step that keeps state on a module (snnTorch ``init_hidden=True``
neurons, a SpikingJelly-style ``self.v``) names the way out that works. It advised
``plan=BPTT()`` until 2026-11-29, with which the backward fails too (torch's "backward
through the graph a second time")."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt.plans import BPTT, Uniform


class KeepsV(nn.Module):
    """A neuron keeping its membrane on itself, SpikingJelly's single-step idiom."""

    def __init__(self) -> None:
        super().__init__()
        self.v: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        v = torch.zeros_like(x) if self.v is None else self.v
        v = 0.5 * v + x
        s = torch.sigmoid(4 * (v - 1.0))
        self.v = v - s
        return s


def _run(plan: object) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), KeepsV())
    x = torch.rand(9, 3, 6) * 2
    ys, _ = spikeckpt.scan(lambda s, x_t: (s, net(x_t)), x, torch.zeros(()), plan=plan)
    ys.sum().backward()


def test_advice_leaves_out_bptt() -> None:
    with pytest.raises(spikeckpt.UsageError, match="keeps state outside its arguments") as info:
        _run(Uniform(3))
    assert "use plan=spikeckpt.plans.BPTT()" not in str(info.value)
    assert "forward(x, state) -> (y, state)" in str(info.value)


def test_bptt_is_no_way_out() -> None:
    """Why the advice went: BPTT() fails on the same step."""
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _run(BPTT())
