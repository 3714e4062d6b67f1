"""A Norse cell of ``coba_lif_feed_forward_step``, which Norse 1.1.0 has no module of (its
``CobaLIFCell`` runs the recurrent ``coba_lif_step``), built as Norse builds its cells."""

from __future__ import annotations

import warnings

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
