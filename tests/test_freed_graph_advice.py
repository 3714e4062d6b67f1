"""The error for a scan step that keeps state on a module (snnTorch ``init_hidden=True``
neurons, a SpikingJelly-style ``self.v``) names a way out that works: ``plan=BPTT()`` runs,
with the loop's gradients, from an initial state of full shape or ``()``; from a state that
step 0 shapes (``None``, empty, 0-d) step 0 runs apart and BPTT fails with torch's "backward
through the graph a second time", which the advice left out until 2026-11-29."""

from __future__ import annotations

from typing import Any

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


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), KeepsV())


_X = torch.rand(9, 3, 6, generator=torch.Generator().manual_seed(1)) * 2


def _scan(net: nn.Module, plan: object, state0: Any) -> nn.Module:
    ys, _ = spikeckpt.scan(lambda s, x_t: (s, net(x_t)), _X, state0, plan=plan)
    ys.pow(2).sum().backward()
    return net


def test_advice_names_the_state_bptt_needs() -> None:
    with pytest.raises(spikeckpt.UsageError, match="keeps state outside its arguments") as info:
        _scan(_net(), Uniform(3), torch.zeros(3, 1))
    assert "BPTT(), which does not recompute, with an initial state of full shape" in str(
        info.value
    )
    assert "forward(x, state) -> (y, state)" in str(info.value)


@pytest.mark.parametrize("state0", [torch.zeros(3, 1), ()], ids=["full", "empty-tuple"])
def test_bptt_from_a_full_state_gives_the_loops_gradients(state0: Any) -> None:
    ref, net = _net(), _net()
    torch.stack([ref(x_t) for x_t in _X]).pow(2).sum().backward()
    _scan(net, BPTT(), state0)
    for p, q in zip(ref.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_bptt_from_a_state_step_0_shapes_fails() -> None:
    """What the advice warns of (torch's own error: left as it is)."""
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _scan(_net(), BPTT(), None)
