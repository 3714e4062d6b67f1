"""A neuron of yours that returns a record beside its output (Rockpool's ``(y, state,
record)``) is refused naming the way out, ``((y, record), state)``, which runs as your loop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt.plans import Uniform


def _spike(v: Tensor) -> Tensor:
    s = torch.sigmoid(4 * (v - 1))
    return s + ((v > 1).to(v) - s).detach()


class ThreeOutputs(nn.Module):
    def forward(self, x: Tensor, v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        v = torch.zeros_like(x) if v is None else v
        v = 0.9 * v + x
        s = _spike(v)
        return s, v - s, v.detach()


class RecordWithY(nn.Module):
    def forward(self, x: Tensor, v: Tensor | None = None) -> tuple[tuple[Tensor, Tensor], Tensor]:
        v = torch.zeros_like(x) if v is None else v
        v = 0.9 * v + x
        s = _spike(v)
        return (s, v.detach()), v - s


def test_a_third_output_is_refused_naming_the_nested_form() -> None:
    net = nn.Sequential(nn.Linear(3, 4), ThreeOutputs())
    with pytest.raises(spikeckpt.UnsupportedLayerError, match=r"\(\(y, record\), state\)"):
        spikeckpt.wrap(net, plan=Uniform(2))(torch.rand(5, 2, 3))


def test_the_nested_form_runs_as_the_loop() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), RecordWithY())
    ref = copy.deepcopy(net)
    x = torch.rand(7, 2, 3) * 2
    v, ys, recs = None, [], []
    for x_t in x:
        (y, rec), v = ref[1](ref[0](x_t), v)
        ys.append(y)
        recs.append(rec)
    torch.stack(ys).pow(2).sum().backward()
    y_w, rec_w = spikeckpt.wrap(net, plan=Uniform(3))(x)
    y_w.pow(2).sum().backward()
    assert torch.equal(rec_w, torch.stack(recs))
    assert torch.equal(y_w, torch.stack(ys))
    for p, q in zip(ref.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)
