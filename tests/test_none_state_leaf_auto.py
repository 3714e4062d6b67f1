"""A module of yours whose state keeps a ``None`` entry that stays ``None`` (``{"h": h,
"extra": None}``): the stack carries it as it is. Before 2026-11-29 ``granularity="auto"``
refused the model ("every state leaf must be a tensor; its state leaf 1 is NoneType"),
although the stack it would choose runs it; now "auto" runs the stack, with the loop's
results, and ``granularity="layer"`` refuses it naming ``granularity='stack'``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc


class NoneEntryGRU(nn.Module):
    """A GRU cell whose dict state has an entry that stays None."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(6, 8)

    def initial_state(self, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """A zero hidden state and an unused entry."""
        return {"h": torch.zeros(x.shape[0], 8), "extra": None}

    def forward(
        self, x: torch.Tensor, state: dict[str, torch.Tensor | None]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        """One step."""
        h = self.cell(x, state["h"])
        return torch.tanh(h), {"h": h, "extra": None}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), NoneEntryGRU())


def _loop(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    state, ys = net[1].initial_state(x[0]), []
    for x_t in x:
        y, state = net[1](net[0](x_t), state)
        ys.append(y)
    return torch.stack(ys)


@pytest.mark.parametrize(
    "options",
    [
        {"plan": sc.plans.Uniform(3), "granularity": "auto"},
        {"plan": "auto", "budget": "64MiB", "granularity": "auto"},
    ],
    ids=["uniform", "budget"],
)
def test_auto_runs_the_stack_with_the_loops_results(options: dict[str, object]) -> None:
    x = torch.randn(12, 4, 5)
    net = _net()
    expected = _loop(net, x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    out = sc.wrap(net, **options)(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    for p, g in zip(net.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_layerwise_refuses_it_naming_the_stack() -> None:
    with pytest.raises(sc.UnsupportedLayerError, match=r"'1'.*None.*granularity='stack'"):
        sc.wrap(_net(), plan=sc.plans.Uniform(3), granularity="layer")(torch.randn(12, 4, 5))
