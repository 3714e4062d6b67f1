"""A layer of yours that takes the state after the input but loops over the whole sequence
itself (SpikingParrot's ``SpikingLayer.forward(x, syn, mem)``: ``for step in range(seq_len)``
over an snnTorch ``SLSTM``). Read as a neuron by its arity, it was refused with "calling it with
zero states failed (ValueError('not enough values to unpack ...')); give it an
initial_state(x) method", which does not help: the refusal now says it loops over time and
shows the way to ``spikeckpt.scan``, which runs its loop body as the loop does."""

from __future__ import annotations

from typing import Any

import pytest
import snntorch as snn
import torch
from torch import Tensor, nn

import spikeckpt as sc


class SpikingLayer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.fc = nn.Linear(dim, dim)
        self.slstm = snn.SLSTM(input_size=dim, hidden_size=dim, learn_threshold=True)

    def forward(self, x: Tensor, syn: Tensor, mem: Tensor) -> Any:
        batch_size, seq_len, _ = x.shape
        spks = torch.zeros(batch_size, seq_len, self.dim, dtype=x.dtype)
        for step in range(seq_len):
            spk, syn, mem = self.slstm(x[:, step, :], syn, mem)
            spks[:, step] = spk
        return self.fc(spks), syn, mem


@pytest.mark.parametrize("in_stack", [True, False])
def test_a_layer_looping_over_the_sequence_is_refused_showing_scan(in_stack: bool) -> None:
    torch.manual_seed(0)
    layer = SpikingLayer(6)
    x = torch.randn(3, 10, 6)
    with pytest.raises(sc.UnsupportedLayerError, match=r"loops over range.*slstm \(SLSTM\)") as err:
        model = nn.Sequential(nn.Linear(6, 6), layer) if in_stack else layer
        sc.wrap(model, plan=sc.plans.Uniform(3), batch_first=True)(x)
    assert "spikeckpt.scan" in str(err.value)
    assert "initial_state(x) method" not in str(err.value).splitlines()[0]


def test_the_scan_route_runs_as_the_layers_own_loop() -> None:
    torch.manual_seed(0)
    layer = SpikingLayer(6)
    x = torch.randn(3, 10, 6)
    out_loop, syn_l, mem_l = layer(x, *layer.slstm.reset_mem())

    def step(state: Any, x_t: Tensor) -> Any:
        spk, syn, mem = layer.slstm(x_t, *state)
        return (syn, mem), spk

    spks, (syn, mem) = sc.scan(
        step, x.transpose(0, 1), layer.slstm.reset_mem(), plan=sc.plans.Uniform(3)
    )
    assert torch.equal(layer.fc(spks.transpose(0, 1)), out_loop)
    assert torch.equal(syn, syn_l) and torch.equal(mem, mem_l)
