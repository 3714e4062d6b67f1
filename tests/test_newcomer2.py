"""A newcomer's second hour, round 2: Lightning as a newcomer runs it, snnTorch options and
Norse models as their examples write them, and torch usage around a wrapped model, each
against the plain loop (or refused with a clear error)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc

snn = pytest.importorskip("snntorch")

T, B, C, K = 40, 4, 12, 3


def _fc_net() -> nn.Module:
    return nn.Sequential(nn.Linear(C, 16), snn.Leaky(0.9), nn.Linear(16, K), snn.Leaky(0.9))


def _spikes(shape: tuple[int, ...], p: float = 0.3) -> Tensor:
    return (torch.rand(shape) < p).float()


def test_the_smallest_budget_named_holds_a_model_that_draws_nothing() -> None:
    """The stack engine captures the CPU generator's state (5,056 bytes) at the start of a
    run and again at each stored checkpoint and at the forward's end, to compare (whether the
    steps drew): two states live at once, but the account counted one. On a small model at
    the smallest budget a refusal named, the step came out over it (19,368 of 18,780 bytes;
    under ``MemoryBudget`` the callback re-planned and refused its own number). Now within."""
    torch.manual_seed(0)
    x = _spikes((T, B, C))
    net = _fc_net()
    with pytest.raises(sc.BudgetTooSmall) as info:
        sc.wrap(net, plan="auto", budget=1000, readout="sum")(x)
    smallest = info.value.minimum_bytes
    seq = sc.wrap(net, plan="auto", budget=smallest, readout="sum")
    for _ in range(2):
        with sc.MemoryMeter() as meter:
            meter.track([x])
            seq(x).sum().backward()
        assert meter.peak_bytes <= smallest
