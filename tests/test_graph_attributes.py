"""A tensor computed from a parameter before the call and held by a layer (``lif.beta =
torch.sigmoid(raw)`` assigned after wrapping, a neuron of yours with ``self.beta =
torch.sigmoid(raw)``): the graph behind it can be backpropagated once, and a plan that
recomputes steps needs it again. Before 2026-11-29 only a snnTorch buffer set before
``wrap`` was refused; set after, the call raised UnlistedParamsError advising
``params=[raw]``, and with that the backward failed with a UsageError about hooks and
``init_hidden`` (stack, layer-wise) or torch's "backward through the graph a second time"
(``granularity="auto"``). Now each call refuses it naming the attribute and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc

CONFIGS = [
    dict(granularity="stack", plan=sc.plans.Revolve(2)),
    dict(granularity="layer"),
    dict(granularity="auto"),
]


class MyLIF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.beta = torch.tensor(0.9)
        self._gain = torch.tensor(1.0)

    def forward(self, x, mem):
        mem = self.beta * mem + self._gain * x
        spk = (mem > 1).float() + mem - mem.detach()
        return spk, mem - spk.detach()


def _x() -> torch.Tensor:
    torch.manual_seed(0)
    return (torch.rand(12, 3, 8) < 0.4).float()


@pytest.mark.parametrize("params", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_snntorch_buffer_set_after_wrap_is_refused(cfg, params):
    snn = pytest.importorskip("snntorch")
    raw = nn.Parameter(torch.full((6,), 1.5))
    net = nn.Sequential(
        nn.Linear(8, 6),
        snn.Leaky(beta=0.9, init_hidden=True),
        nn.Linear(6, 3),
        snn.Leaky(beta=0.8, init_hidden=True),
    )
    seq = sc.wrap(net, params=[raw] if params else None, **cfg)
    net[1].beta = torch.sigmoid(raw)
    with pytest.raises(sc.UnsupportedLayerError, match="beta.*graph made before the call"):
        seq(_x())


@pytest.mark.parametrize("params", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_own_neuron_attribute_with_a_graph_is_refused(cfg, params):
    raw = nn.Parameter(torch.full((6,), 1.5))
    net = nn.Sequential(nn.Linear(8, 6), MyLIF(), nn.Linear(6, 3), MyLIF())
    seq = sc.wrap(net, params=[raw] if params else None, **cfg)
    net[1].beta = torch.sigmoid(raw)
    with pytest.raises(sc.UnsupportedLayerError, match="'beta'.*parametrization"):
        seq(_x())


def test_private_attribute_with_a_graph_is_refused():
    raw = nn.Parameter(torch.tensor(0.0))
    net = nn.Sequential(nn.Linear(8, 6), MyLIF())
    net[1]._gain = torch.exp(raw)
    with pytest.raises(sc.UnsupportedLayerError, match="'_gain'.*graph made before the call"):
        sc.wrap(net, plan=sc.plans.Revolve(2), params=[raw])(_x())


def test_leaf_attribute_and_norse_parameters_still_run():
    norse = pytest.importorskip("norse.torch")
    raw = nn.Parameter(torch.full((6,), 1.5))
    net = norse.SequentialState(nn.Linear(8, 6), norse.LIFCell(), nn.Linear(6, 3), norse.LICell())
    net[1].p = norse.LIFParameters(tau_mem_inv=100 * torch.sigmoid(raw))
    out, _ = sc.wrap(net, plan=sc.plans.Revolve(2))(_x())
    out.sum().backward()
    assert raw.grad is not None
    own = nn.Sequential(nn.Linear(8, 6), MyLIF())
    own[1].beta = torch.full((6,), 0.9, requires_grad=True)  # a leaf: differentiated
    sc.wrap(own, plan=sc.plans.Revolve(2))(_x()).sum().backward()
    assert own[1].beta.grad is not None
