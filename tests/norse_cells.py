"""Shared Norse test helpers: Norse's tutorial loop, the round-off comparison of the fused
kernels' tests, the check of a cell with a learnable parameter field, a count of the recurrent
kernels' input gathers, and a cell of ``coba_lif_feed_forward_step``, which Norse 1.1.0 has no module
of (its ``CobaLIFCell`` runs the recurrent ``coba_lif_step``), built as Norse builds its
cells."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

import spikeckpt as sc

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
    scale = max(1.0, float(a.detach().abs().max())) if a.numel() else 1.0
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * scale)


def check_learnable_field(net: nn.Module, x: Tensor, field: Tensor, want: Tensor) -> None:
    """``net``'s cell with a learnable parameter field (``field``, an ``nn.Parameter`` in its
    NamedTuple, which the kernels take no gradient for) runs per step layer-wise: outputs
    bitwise ``want`` (Norse's loop's, still taped), every gradient, the field's too, at
    round-off; with the field fixed the cell runs fused."""
    wrt = [*net.parameters(), field]
    want_grads = torch.autograd.grad(want.sum(), wrt)
    assert want_grads[-1].abs().sum() > 0
    seq = sc.wrap(net, granularity="layer", chunk=4)
    out = seq(x)
    got = out[0] if isinstance(out, tuple) else out  # a SequentialState returns its state too
    assert [b.neuron for b in seq.last_stats.blocks] == ["per-step"]
    assert torch.equal(got, want)
    for a, b in zip(want_grads, torch.autograd.grad(got.sum(), wrt), strict=True):
        close(a, b)
    field.requires_grad_(False)
    seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]


@contextlib.contextmanager
def counted_gathers() -> Iterator[list[int]]:
    """Inside, each input gather of a recurrent kernel (`recurrent_kernel.gather`) appends
    to the list given."""
    from spikeckpt.adapters import recurrent_kernel

    gather, calls = recurrent_kernel.gather, []

    def counted(*args: Any, **kwargs: Any) -> Tensor:
        calls.append(1)
        return gather(*args, **kwargs)

    recurrent_kernel.gather = counted
    try:
        yield calls
    finally:
        recurrent_kernel.gather = gather


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
