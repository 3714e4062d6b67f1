"""``state=`` for torch's recurrent cells in a wrapped stack: one of another batch (a previous
batch's final state carried into a smaller last batch) or another structure is refused
naming the layer and the shape to pass; before 2026-11-29 torch's "Input batch size 4
doesn't match hidden0 batch size 2" came from inside the run, naming neither. A state of the
right shape still continues a sequence exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc


@pytest.mark.parametrize(
    ("cell", "state", "expected"),
    [
        (nn.GRUCell(6, 5), torch.zeros(2, 5), r"layer 1 \(GRUCell\).*\(4, 5\).*got \(2, 5\)"),
        (
            nn.LSTMCell(6, 5),
            (torch.zeros(2, 5), torch.zeros(2, 5)),
            r"layer 1 \(LSTMCell\).*h and c.*\(4, 5\)",
        ),
        (nn.LSTMCell(6, 5), torch.zeros(4, 5), r"layer 1 \(LSTMCell\).*\(h, c\)"),
    ],
    ids=["gru-batch", "lstm-batch", "lstm-h-alone"],
)
def test_a_state_of_another_shape_is_refused_naming_the_layer(
    cell: nn.Module, state: object, expected: str
) -> None:
    seq = sc.wrap(nn.Sequential(nn.Linear(6, 6), cell), plan=sc.plans.Uniform(3))
    with pytest.raises(sc.ConfigError, match=expected):
        seq(torch.randn(12, 4, 6), state=[(), state])


@pytest.mark.parametrize("cell", [nn.GRUCell(6, 5), nn.LSTMCell(6, 5)], ids=["gru", "lstm"])
def test_a_returned_state_continues_the_sequence(cell: nn.Module) -> None:
    torch.manual_seed(0)
    x = torch.randn(12, 4, 6)
    seq = sc.wrap(nn.Sequential(nn.Linear(6, 6), cell), plan=sc.plans.Uniform(3))
    full = seq(x)
    first, state = seq(x[:5], return_state=True)
    assert torch.equal(torch.cat([first, seq(x[5:], state=state)]), full)
