"""snnTorch's surrogate spike functions' backwards written out, for the fused kernels.

A fused kernel takes dL/du through the spike at ``u = mem - threshold``; without a written
form it runs the surrogate's own ``torch.autograd.Function`` backward by autograd (`vjp`),
which the recurrent kernels (``RLeaky``, ``RSynaptic``) and ``Leaky(reset_delay=False)`` do
once per step. Written out here, for ``atan``, ``fast_sigmoid``, ``sigmoid`` and
``triangular`` (the closures ``snntorch.surrogate`` returns, found by their code), with the
operations of snnTorch's backward in the same order, the result in ``u``'s dtype (autograd
casts a backward's result to its input's): bitwise the loop's gradients.

``atan``'s backward is ``slope(u) * grad`` (`scaling`): a recurrence takes its slope once per
chunk. The others divide, or multiply in another order, so each step's gradient goes through
the written form itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from spikeckpt.adapters.kernels import SpikeGrad, scaling

__all__ = ["written_grad"]


def written_grad(spike: Any) -> SpikeGrad | None:
    """The backward of ``spike`` (a ``snntorch.surrogate`` closure: ``atan(alpha)``,
    ``fast_sigmoid(slope)``, ``sigmoid(slope)``, ``triangular(threshold)``) written out, or
    None for any other spike function (or one whose constant is not a number)."""
    if getattr(spike, "__module__", None) != "snntorch.surrogate":
        return None
    code, closure = getattr(spike, "__code__", None), getattr(spike, "__closure__", None)
    qualname = getattr(spike, "__qualname__", "")
    make = _WRITTEN.get(qualname.removesuffix(".<locals>.inner"))
    if make is None or code is None or not closure or len(code.co_freevars) != 1:
        return None
    name, value = code.co_freevars[0], closure[0].cell_contents
    if name != make[0] or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return make[1](value)


def _atan(alpha: float) -> SpikeGrad:
    """``ATan.backward``: ``alpha / 2 / (1 + (pi / 2 * alpha * u).pow_(2)) * grad``, where
    ``float / tensor`` is ``tensor.reciprocal() * float``."""
    scale, half = torch.pi / 2 * alpha, alpha / 2

    def grad(u: Tensor, g: Tensor) -> Tensor:  # u is the caller's to overwrite
        u.mul_(scale)
        u.pow_(2)
        u.add_(1)
        u.reciprocal_()
        u.mul_(half)
        return u.mul_(g)

    return scaling(grad)


def _fast_sigmoid(slope: float) -> SpikeGrad:
    """``FastSigmoid.backward``: ``grad / (slope * abs(u) + 1.0) ** 2``."""

    def grad(u: Tensor, g: Tensor) -> Tensor:
        u.abs_()
        u.mul_(slope)
        u.add_(1.0)
        u.pow_(2)
        return _divided(g, u)

    return grad


def _sigmoid(slope: float) -> SpikeGrad:
    """``Sigmoid.backward``: ``grad * slope * exp(-slope * u) / (exp(-slope * u) + 1) ** 2``
    (left to right)."""

    def grad(u: Tensor, g: Tensor) -> Tensor:
        dtype = u.dtype
        e = u.mul_(-slope).exp_()
        out = g * slope * e
        e.add_(1)
        e.pow_(2)
        return out.div_(e).to(dtype)

    return grad


def _triangular(threshold: float) -> SpikeGrad:
    """``Triangular.backward``: ``grad * threshold``, negated where ``u >= 0``."""

    def grad(u: Tensor, g: Tensor) -> Tensor:
        out = g * threshold
        return torch.where(u >= 0, -out, out).to(u.dtype)

    return grad


def _divided(g: Tensor, d: Tensor) -> Tensor:
    """``g / d`` in ``d``'s dtype (into ``d`` where its shape holds the result)."""
    return torch.div(g, d, out=d) if d.shape == g.shape else (g / d).to(d.dtype)


#: surrogate name -> (its closure's constant, the backward made from it)
_WRITTEN: dict[str, tuple[str, Callable[[float], SpikeGrad]]] = {
    "atan": ("alpha", _atan),
    "fast_sigmoid": ("slope", _fast_sigmoid),
    "sigmoid": ("slope", _sigmoid),
    "triangular": ("threshold", _triangular),
}
