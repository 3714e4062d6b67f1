"""Dropout at two positions of a model called on the whole sequence (Norse's ``vgg``: an
``nn.Sequential`` of ``Lift(...)`` and ``LIF()`` with ``Lift(nn.Dropout())`` twice).

``model(x)`` draws the first Dropout's masks for every step before the next layer runs; the
wrapped model steps over time, drawing at each position in turn: other masks under the same
seed, so its gradients were 17-36% off ``model(x)``'s without a word (its outputs can be
bitwise equal when the masked spikes are few). wrap now warns, naming the positions; one
Dropout draws the same masks either way and runs exactly.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from norse.torch import LIF, Lift
from torch import nn

import spikeckpt as sc


def _vgg_like(dropouts: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [Lift(nn.Linear(16, 24)), LIF(), Lift(nn.Dropout(0.5))]
    layers += [Lift(nn.Linear(24, 24)), LIF()]
    layers += [Lift(nn.Dropout(0.5))] if dropouts == 2 else []
    layers += [Lift(nn.Linear(24, 5))]
    return nn.Sequential(*layers)


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(123)
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_two_dropouts_warn_naming_them() -> None:
    with pytest.warns(UserWarning, match=r"Dropout at 2 positions \(2.lifted_module, 5.lifted"):
        sc.wrap(_vgg_like(2))


def test_nested_sequences_warn_too() -> None:
    """Norse's mobilenet: ``ConvBNReLU`` is an ``nn.Sequential`` of ``Lift`` and ``LIF()``."""
    torch.manual_seed(0)
    block = nn.Sequential(Lift(nn.Linear(16, 16)), LIF())
    net = nn.Sequential(block, Lift(nn.Dropout(0.2)), nn.Sequential(Lift(nn.Linear(16, 4)), LIF()))
    net.append(Lift(nn.Dropout(0.2)))
    with pytest.warns(UserWarning, match="Dropout at 2 positions"):
        sc.wrap(net)


def test_one_dropout_runs_as_model_call_without_warning() -> None:
    x = torch.rand(12, 3, 16) * 3
    expected = _grads(_vgg_like(1), x)
    net = _vgg_like(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        seq = sc.wrap(net, plan=sc.plans.Revolve(3))
    for got, want in zip(_grads(seq, x), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_two_dropouts_draw_other_masks_than_model_call() -> None:
    """What the warning says: the gradients differ from ``model(x)``'s in training mode."""
    x = torch.rand(12, 3, 16) * 3
    expected = _grads(_vgg_like(2), x)
    with pytest.warns(UserWarning, match="other masks"):
        seq = sc.wrap(_vgg_like(2), plan=sc.plans.BPTT())
    got = _grads(seq, x)
    assert any(not torch.allclose(g, w) for g, w in zip(got, expected, strict=True))
