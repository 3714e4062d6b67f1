"""Norse's threshold functions' backwards written out, for the fused kernels.

Every Norse kernel takes the spike's slope over a chunk, ``threshold(u, method, alpha)``'s
backward at ``u = v - v_th`` for a gradient of ones (or for the chunk's gradient), which ran
Norse's ``torch.autograd.Function`` by autograd (`vjp`) at every chunk's backward. Written out
here for ``"super"`` (Norse's default), ``"tanh"`` and ``"triangle"``, with the operations of
Norse's backward in the same order: bitwise its gradients, without autograd's graph.
``"circ"`` and ``"heavi_erfc"`` keep their own backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from spikeckpt.adapters.kernels import SpikeGrad

__all__ = ["host_slope", "written_norse_grad"]


def written_norse_grad(method: Any, alpha: Any) -> SpikeGrad | None:
    """The backward of Norse's ``threshold(u, method, alpha)`` written out, ``(u, grad) ->
    dL/du`` (``u`` the caller's to overwrite, ``grad`` in ``u``'s dtype), or None for a method
    written nowhere here."""
    make = _WRITTEN.get(method) if isinstance(method, str) else None
    return None if make is None else make(alpha)


def host_slope(method: Any) -> str | None:
    """The name under which the compiled Norse backward takes ``threshold(u, method,
    alpha)``'s slope in its loop (`spikeckpt.adapters.jit_loops.NORSE_SLOPES`): ``"super"``
    (its slope reads no ``alpha``), else None (the kernel then takes the slope as above)."""
    return "super" if method == "super" else None


def _super(alpha: Any) -> SpikeGrad:
    """``SuperSpike.backward``: ``grad / (abs(u) + 1.0).pow(2)`` (Norse's reads no alpha)."""

    def grad(u: Tensor, g: Tensor) -> Tensor:
        u.abs_()
        u.add_(1.0)
        u.pow_(2)
        return torch.div(g, u, out=u) if g.shape == u.shape else g / u

    return grad


def _tanh(alpha: Any) -> SpikeGrad:
    """``HeaviTanh.backward``: ``grad * (1 - (u * alpha).tanh().pow(2))``."""

    def grad(u: Tensor, g: Tensor) -> Tensor:
        u.mul_(alpha)
        u.tanh_()
        u.pow_(2)
        u.neg_()
        u.add_(1)  # 1 - t, as -t + 1: the same rounding
        return torch.mul(g, u, out=u) if g.shape == u.shape else g * u

    return grad


def _triangle(alpha: Any) -> SpikeGrad:
    """``Triangle.backward``: ``grad * alpha * relu(1 - abs(u))``."""

    def grad(u: Tensor, g: Tensor) -> Tensor:
        u.abs_()
        u.neg_()
        u.add_(1)
        u.relu_()
        return (g * alpha).mul_(u)

    return grad


#: Norse method -> the backward made from its ``alpha``
_WRITTEN: dict[str, Callable[[Any], SpikeGrad]] = {
    "super": _super,
    "tanh": _tanh,
    "triangle": _triangle,
}
