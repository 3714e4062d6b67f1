"""Shared test helpers: snnTorch's explicit-state loop as its tutorials write it, and a count
of the layer-wise gathers."""

from __future__ import annotations

from typing import Any

import pytest
import snntorch as snn
import torch
from torch import Tensor, nn


def leaky_loop(net: nn.Sequential, x: Tensor) -> tuple[Tensor, Tensor]:
    """Each step through every layer of ``net`` (``snn.Leaky`` with explicit membranes, zeros
    at t=0): the top layer's ``(spikes (T, B, n), membranes (T, B, n))``."""
    mems: dict[int, Tensor] = {}
    spikes, top_mems = [], []
    for x_t in x:
        h = x_t
        for i, layer in enumerate(net):
            if isinstance(layer, snn.Leaky):
                h, mems[i] = layer(h, mems.get(i, torch.zeros_like(h)))
            else:
                h = layer(h)
        spikes.append(h)
        top_mems.append(mems[len(net) - 1])
    return torch.stack(spikes), torch.stack(top_mems)


def gather_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The weight shapes of every layer-wise gather from now on (the test's monkeypatch)."""
    from spikeckpt.adapters import affine, gather

    seen: list[tuple[int, ...]] = []
    real = gather.gather

    def spy(weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        seen.append(tuple(weight.shape))
        return real(weight, *args, **kwargs)

    monkeypatch.setattr(gather, "gather", spy)
    monkeypatch.setattr(affine, "gather", spy)
    return seen
