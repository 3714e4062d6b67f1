"""torch layers built with ``inplace=True`` (``nn.Dropout(0.3, inplace=True)``,
``nn.ReLU(inplace=True)``, copied from ANN code) right after a neuron: the plain loop and the
stack granularity run them, but before 2026-11-29 the layer-wise granularity, and
``granularity="auto"``, which picks it, failed in the backward with torch's "a view of a
leaf Variable that requires grad is being used in an in-place operation" (``exact=True``:
"Output 0 of Select is a view and is being modified inplace"): a block's recomputation
hands its first layer the stored spikes as a leaf. That layer now gets a copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc


def _net(layer: nn.Module | list[nn.Module]) -> nn.Sequential:
    snn = pytest.importorskip("snntorch")
    from snntorch import surrogate

    g = surrogate.fast_sigmoid(25)
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(8, 12),
        snn.Leaky(0.9, init_hidden=True, spike_grad=g, learn_beta=True),
        *(layer if isinstance(layer, list) else [layer]),
        nn.Linear(12, 4),
        snn.Leaky(0.8, init_hidden=True, spike_grad=g),
    )


def _loop(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for m in net.modules():
        if hasattr(m, "reset_hidden"):
            m.reset_hidden()
    return torch.stack([net(x_t) for x_t in x])


LAYERS = {
    "dropout": lambda: nn.Dropout(0.3, inplace=True),
    "flatten_dropout": lambda: [nn.Flatten(1), nn.Dropout(0.3, inplace=True)],
    "relu": lambda: nn.ReLU(inplace=True),
    "hardtanh": lambda: nn.Hardtanh(0.0, 0.5, inplace=True),
}


@pytest.mark.parametrize(
    "cfg",
    [
        dict(granularity="layer"),
        dict(granularity="auto"),
        dict(granularity="layer", exact=True),
        dict(granularity="layer", chunk=3),
    ],
)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_inplace_layer_after_a_neuron_is_the_loops(kind, cfg):
    torch.manual_seed(0)
    x = torch.rand(10, 3, 8) * 2 - 0.5
    ref, net = _net(LAYERS[kind]()), _net(LAYERS[kind]())
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(9)
    expected = _loop(ref, xr)
    expected.pow(2).sum().backward()
    torch.manual_seed(9)
    out = sc.wrap(net, **cfg)(xs)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(xs.grad, xr.grad)
    for p, q in zip(ref.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)


class _Double(nn.Module):
    def forward(self, x):
        return x.mul_(2.0)  # a layer of yours writing its input in place


@pytest.mark.parametrize("cfg", [dict(granularity="layer"), dict(granularity="layer", exact=True)])
def test_own_layer_writing_its_input_in_place_is_told(cfg):
    torch.manual_seed(0)
    x = torch.rand(10, 3, 8) * 2
    seq = sc.wrap(_net(_Double()), **cfg)
    with pytest.raises(
        sc.UnsupportedLayerError, match=r"'2', '3' changes its input in place.*granularity='stack'"
    ):
        seq(x).sum().backward()


def test_auto_runs_a_layer_writing_its_input_in_place_in_the_stack():
    """``granularity="auto"`` picked layer-wise for it and raised the error above, where the
    stack (``granularity="stack"``) runs it as the loop does: its probe now finds it and
    the stack runs."""
    torch.manual_seed(0)
    x = torch.rand(10, 3, 8) * 2
    ref, net = _net(_Double()), _net(_Double())
    expected = _loop(ref, x)
    expected.pow(2).sum().backward()
    seq = sc.wrap(net, granularity="auto")
    out = seq(x)
    out.pow(2).sum().backward()
    assert seq.last_stats.granularity == "stack"
    assert torch.equal(out, expected)
    for p, q in zip(ref.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)
