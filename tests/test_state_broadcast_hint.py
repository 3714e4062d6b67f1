"""A learned initial state of shape ``(1, H)`` that the plain loop broadcasts to ``(B, H)`` at
step 0 (``h = tanh(wx(x) + wh(h0))``): a checkpointed run keeps the state's shape fixed, so it
is refused. Before 2026-11-29 the refusal said only that the shape changed and suggested the
input's layout (``x.transpose(0, 1)``, ``steps=T``), which is not the cause; now it says the
state broadcast and names the fix, ``h0.expand(B, H)``, which gives the loop's gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc


class H0RNN(nn.Module):
    """An Elman step whose learned initial state is ``(1, H)`` or expanded to the batch."""

    def __init__(self, expand: bool) -> None:
        super().__init__()
        self.wx = nn.Linear(6, 8)
        self.wh = nn.Linear(8, 8)
        self.h0 = nn.Parameter(torch.randn(1, 8))
        self.expand = expand

    def initial_state(self, x: torch.Tensor) -> torch.Tensor:
        """``h0``, expanded to the batch of ``x`` where asked."""
        return self.h0.expand(x.shape[0], -1) if self.expand else self.h0

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step."""
        h = torch.tanh(self.wx(x) + self.wh(h))
        return h, h


@pytest.mark.parametrize("plan", [sc.plans.BPTT(), sc.plans.Uniform(3)], ids=repr)
def test_broadcast_initial_state_is_refused_naming_the_expand(plan: object) -> None:
    torch.manual_seed(0)
    x = torch.randn(10, 4, 6)
    with pytest.raises(sc.ConfigError) as err:
        sc.wrap(H0RNN(expand=False), plan=plan)(x)
    message = str(err.value)
    assert "broadcast" in message and "h0.expand(4, 8)" in message
    assert "transpose" not in message  # the input's layout is not the cause


def test_the_expanded_state_gives_the_loops_gradients() -> None:
    torch.manual_seed(0)
    x = torch.randn(10, 4, 6)
    model = H0RNN(expand=False)
    h, ys = model.h0, []
    for x_t in x:
        y, h = model(x_t, h)
        ys.append(y)
    torch.stack(ys).pow(2).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.expand = True
    out, _ = sc.wrap(model, plan=sc.plans.Uniform(3))(x)
    out.pow(2).sum().backward()
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)
