"""Shared Norse test helpers: Norse's tutorial loop, the round-off comparison of the fused
kernels' tests, and a cell of ``coba_lif_feed_forward_step``, which Norse 1.1.0 has no module
of (its ``CobaLIFCell`` runs the recurrent ``coba_lif_step``), built as Norse builds its
cells."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from norse.torch.functional.coba_lif import (
        CobaLIFFeedForwardState,
        CobaLIFParameters,
        coba_lif_feed_forward_step,
    )
    from norse.torch.module.snn import SNN, SNNCell


def norse_loop(model: Callable[..., Any], x: Tensor, state: Any = None) -> Tensor:
    """Norse's tutorial loop: ``z, state = model(x_t, state)`` per step, outputs stacked."""
    out = []
    for x_t in x:
        z, state = model(x_t, state)
        out.append(z)
    return torch.stack(out)


def close(a: Tensor, b: Tensor) -> None:
    """``b`` equals ``a`` at float32 round-off (relative to ``a``'s largest magnitude)."""
    scale = max(1.0, float(a.abs().max())) if a.numel() else 1.0
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * scale)


#: Norse's default parameters
DEFAULTS = CobaLIFParameters()


def _rest(p: CobaLIFParameters, x: Tensor) -> CobaLIFFeedForwardState:
    """``v`` at ``v_rest``, no conductance, shaped like ``x``."""
    zeros = torch.zeros_like(x)
    return CobaLIFFeedForwardState(v=zeros + p.v_rest, g_e=zeros, g_i=zeros.clone())


class CobaLIFFeedForwardCell(SNNCell):
    """``z, state = cell(x_t, state)`` with Norse's ``coba_lif_feed_forward_step``."""

    def __init__(self, p: CobaLIFParameters = DEFAULTS, dt: float = 0.001) -> None:
        super().__init__(coba_lif_feed_forward_step, self.initial_state, p, dt)

    def initial_state(self, x: Tensor) -> CobaLIFFeedForwardState:
        return _rest(self.p, x)


class CobaLIFFeedForward(SNN):
    """Its sequence module: ``z, state = module(x)`` over ``x (T, B, ...)``."""

    def __init__(self, p: CobaLIFParameters = DEFAULTS, dt: float = 0.001) -> None:
        super().__init__(coba_lif_feed_forward_step, self.initial_state, p, dt)

    def initial_state(self, x: Tensor) -> CobaLIFFeedForwardState:
        return _rest(self.p, x[0])
