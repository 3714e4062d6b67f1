"""A step (or a module wrapped alone, ``forward(x_t, h) -> (y, h)``) whose initial state has
another structure than the state it returns (a predictive-coding ALIF net whose
``init_hidden`` builds 10 tensors while its forward returns 9) is refused naming both
structures and the way forward. Before: "not a tuple of 10 tensors like the initial state
(got tuple)", which did not say what the step returned."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt import plans


def _step(h: tuple[Tensor, ...], x_t: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
    mem = 0.9 * h[0] + x_t
    return (mem, h[1] + mem), mem


class TwoStates(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x_t: Tensor, h: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
        mem = 0.9 * h[0] + self.fc(x_t)
        return mem, (mem, h[1] + mem)


@pytest.mark.parametrize("plan", [plans.BPTT(), plans.Uniform(2)])
def test_scan_names_both_structures(plan: object) -> None:
    x = torch.rand(5, 2, 4, requires_grad=True)
    h0 = (torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(spikeckpt.ConfigError) as info:
        spikeckpt.scan(_step, x, h0, plan=plan)
    msg = str(info.value)
    assert "a tuple of 3 tensors" in msg and "a tuple of 2 tensors" in msg
    assert "initial state" in msg


def test_wrapped_alone_names_both_structures() -> None:
    seq = spikeckpt.wrap(TwoStates(), plan=plans.BPTT())
    h0 = (torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(spikeckpt.ConfigError, match="got a tuple of 2 tensors"):
        seq(torch.rand(5, 2, 4), state=h0)


def test_the_same_structure_runs() -> None:
    x = torch.rand(5, 2, 4)
    h0 = (torch.zeros(2, 4), torch.zeros(2, 4))
    ys, _ = spikeckpt.scan(_step, x, h0, plan=plans.Uniform(2))
    h, ref = h0, []
    for t in range(5):
        h, y = _step(h, x[t])
        ref.append(y)
    assert torch.equal(ys, torch.stack(ref))
