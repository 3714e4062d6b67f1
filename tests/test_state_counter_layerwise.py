"""A neuron of yours keeping a step counter as a Python ``int`` in its state, layer-wise and
with ``granularity="auto"``: refused naming the layer and ``torch.tensor(0)``, as the stack
refuses it (before: ``'int' object has no attribute 'detach'`` from the planner's probe, and
"block states must be tensors" without the layer layer-wise)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt import plans


class CountingLIF(nn.Module):
    """Its input gain decays with the step count ``t`` kept in the state."""

    def initial_state(self, x: Tensor) -> tuple[Tensor, int]:
        return torch.zeros_like(x), 0

    def forward(self, x: Tensor, state: tuple[Tensor, int]) -> tuple[Tensor, tuple[Tensor, int]]:
        v, t = state
        v = 0.9 * v + x / (1 + t)
        spk = (v > 1).float()
        return spk, (v - spk, t + 1)


@pytest.mark.parametrize(
    "kw",
    [
        {"plan": plans.Uniform(2), "granularity": "layer"},
        {"plan": "auto", "budget": "64MiB", "granularity": "auto"},
    ],
    ids=["layer", "auto"],
)
def test_an_int_counter_in_the_state_is_refused_naming_the_layer(kw: dict) -> None:
    net = nn.Sequential(nn.Linear(4, 3), CountingLIF())
    with pytest.raises(spikeckpt.ConfigTypeError, match=r"layer '1'.*torch\.tensor\(0\)"):
        spikeckpt.wrap(net, **kw)(torch.rand(6, 2, 4))


def test_a_tensor_counter_runs_layerwise_as_the_loop() -> None:
    class TensorCount(CountingLIF):
        def initial_state(self, x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
            return torch.zeros_like(x), torch.zeros(())

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), TensorCount())
    x = torch.rand(6, 2, 4) * 2
    state, want = None, []
    for t in range(6):
        h = net[0](x[t])
        state = state or net[1].initial_state(h)
        y, state = net[1](h, state)
        want.append(y)
    got = spikeckpt.wrap(net, plan=plans.Uniform(2), granularity="layer")(x)
    assert torch.equal(got, torch.stack(want))
