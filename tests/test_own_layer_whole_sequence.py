"""A layer of yours written for the whole sequence (SpikingJelly's ``SeqToANNContainer``,
which flattens ``(T, B)`` before the module it wraps) left in a net ported to per-step
neurons fails on one step: the refusal names the layer and the step's shape, and says the
layer is called once per step. Until 2026-11-29 torch's error came out of the container
("mat1 and mat2 shapes cannot be multiplied (1x48 and 12x16)") with no word of why."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt.plans import Uniform


class SeqToANN(nn.Module):
    """SpikingJelly's SeqToANNContainer: the module over T*B flattened."""

    def __init__(self, *modules: nn.Module) -> None:
        super().__init__()
        self.module = nn.Sequential(*modules)

    def forward(self, x_seq: Tensor) -> Tensor:
        y = self.module(x_seq.flatten(0, 1))
        return y.view([x_seq.shape[0], x_seq.shape[1], *y.shape[1:]])


class LIF(nn.Module):
    """A per-step neuron of yours."""

    def initial_state(self, x: Tensor) -> Tensor:
        return torch.zeros_like(x)

    def forward(self, x: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        v = 0.5 * v + x
        s = torch.sigmoid(4 * (v - 1.0))
        return s, v - s


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_whole_sequence_layer_is_refused(kind: str, granularity: str) -> None:
    if kind == "linear":
        net = nn.Sequential(SeqToANN(nn.Linear(12, 16)), LIF(), nn.Linear(16, 5), LIF())
        x = torch.rand(6, 4, 12)
    else:
        net = nn.Sequential(
            SeqToANN(nn.Conv2d(2, 4, 3)), LIF(), nn.Flatten(), nn.Linear(256, 5), LIF()
        )
        x = torch.rand(6, 4, 2, 10, 10)
    with pytest.raises(
        spikeckpt.UnsupportedLayerError,
        match=rf"layer '0'.*failed on one time step, x_t of shape \({x.shape[1]}, .*"
        r"SeqToANNContainer",
    ):
        spikeckpt.wrap(net, plan=Uniform(3), granularity=granularity)(x)


class Fails(nn.Module):
    """A layer of yours whose error has nothing to do with shapes."""

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("boom")


def test_other_errors_pass_through() -> None:
    net = nn.Sequential(nn.Linear(3, 4), Fails(), nn.RNNCell(4, 2))
    with pytest.raises(RuntimeError, match="^boom$"):
        spikeckpt.wrap(net, plan=Uniform(2))(torch.rand(4, 2, 3))
