"""A ``Linear`` over a sparse input, from the input's non-zeros: gather-sums over the weight.

A chunk of spikes ``flat (rows, in)`` (few ones) times ``weight.T`` is, per row, the sum of the
weight's columns where the row has a one: ``embedding_bag`` over the transposed weight. Its
weight gradient ``grad.T @ flat`` is, per input column, the sum of the rows of ``grad`` where
that input fired: ``embedding_bag`` again, over the rows of ``grad``. Both run a block of the
weight's output rows at a time (`GATHER_BLOCK` elements), so no weight-sized temporary is made
beyond the kept transpose of a small weight.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from spikeckpt.engine.grad import GradSink
from spikeckpt.engine.phase import in_backward

__all__ = [
    "GATHER_BLOCK",
    "GatherLinear",
    "Transposed",
    "column_order",
    "finite",
    "gather",
    "gather_weight_grad",
]

#: a gather transposes the weight a block of output rows at a time, at most this many
#: elements (256 KiB of float32) per block: no weight-sized temporary
GATHER_BLOCK = 1 << 16

#: a weight of at most this many elements (1 MiB of float32) keeps its transpose for the
#: forward pass (made once per pass; the forward pass holds one chunk's spikes, far less than
#: the backward's working set)
KEEP_ELEMENTS = 1 << 18


class Transposed:
    """A small weight transposed, ``(in, out)`` contiguous, made once per forward pass of the
    engine and dropped by the block's cleanup at the end of the pass (a weight changed between
    passes, even through ``.data``, is transposed afresh): only weights of at most
    `KEEP_ELEMENTS` elements, so it costs at most 1 MiB, and not in the engine's backward
    phase (it holds the chunk's working set: the transpose is then made per chunk, for the
    gather only). A probe's forward pass keeps it as the run's does (the planner measures
    it: unseen, a 512 x 512 weight's 1 MiB took a planned chunk to 1.14x its budget)."""

    def __init__(self) -> None:
        self.value: Tensor | None = None
        self.key: tuple[int, int] = (0, 0)

    def of(self, weight: Tensor) -> Tensor | None:
        """``weight.T`` contiguous, or None (a large weight, or the backward phase)."""
        if weight.numel() > KEEP_ELEMENTS or in_backward():
            self.value = None
            return None
        key = (weight.data_ptr(), weight._version)
        if self.value is None or self.key != key:
            self.value, self.key = weight.detach().t().contiguous(), key
        return self.value

    def clear(self) -> None:
        self.value = None


def finite(tensor: Tensor) -> bool:
    """Whether ``tensor`` holds no NaN and no infinity, from its sum (one pass, nothing
    allocated; a sum that overflows says no: the caller then takes the dense product, the
    loop's own). A gather skips the zeros a dense product multiplies: ``0 * inf`` and ``0 *
    nan`` are NaN there."""
    return math.isfinite(float(tensor.detach().sum()))


def gather(
    weight: Tensor,
    n_rows: int,
    rows: Tensor,
    cols: Tensor,
    values: Tensor | None,
    transposed: Tensor | None = None,
    lead: int = 0,
) -> Tensor:
    """``flat @ weight.T`` (``(n_rows, out)``) from the non-zeros of ``flat``: a gather-sum
    over the rows of ``weight.T``, for a block of output features at a time (each block's
    transposed copy is a contiguous slice of rows of ``weight``, fast to transpose). Every
    output element is the same sum, in the same order, whatever the blocks; ``transposed``
    is ``weight.T`` contiguous when the caller keeps one. ``lead``: rows of zeros (empty
    bags) before the first, ``(lead + n_rows, out)`` in all."""
    out, n_in = weight.shape
    counts = torch.bincount(rows, minlength=n_rows)
    if lead:
        counts = torch.cat([counts.new_zeros(lead), counts])
        n_rows += lead
    offsets = (counts.cumsum(0) - counts).to(cols.dtype)  # embedding_bag: one index dtype
    weight = weight.detach()
    step = max(1, GATHER_BLOCK // max(1, n_in))
    if transposed is not None or step >= out:
        if transposed is None:
            transposed = weight.t().contiguous()
        return nn.functional.embedding_bag(
            cols, transposed, offsets, mode="sum", per_sample_weights=values
        )
    z = weight.new_empty(n_rows, out)
    for o0 in range(0, out, step):
        z[:, o0 : o0 + step] = nn.functional.embedding_bag(
            cols, weight[o0 : o0 + step].t().contiguous(), offsets, mode="sum",
            per_sample_weights=values,
        )  # fmt: skip
    return z


def gather_weight_grad(
    grad: Tensor,
    rows: Tensor,
    cols: Tensor,
    values: Tensor | None,
    weight_shape: tuple[int, int],
    target: Tensor | None,
) -> Tensor:
    """``grad.T @ flat`` (``weight_shape``) added into ``target`` in place (made when None)
    and returned: column ``j`` sums the rows of ``grad (n_rows, out)`` where input ``j`` is
    non-zero (bags over the input's columns, rows ascending in each), for a block of output
    rows at a time; each block's bags come out ``(in, block)`` and are added through the
    transposed view of the sum's rows (no transposed copy). A ``grad`` with a NaN or an
    infinity takes the dense product over the input rebuilt from its non-zeros: the loop's
    ``grad.T @ flat`` multiplies it by the zeros too (``inf * 0`` is NaN)."""
    out, n_in = weight_shape
    if not finite(grad):
        flat = grad.new_zeros(grad.shape[0], n_in)
        flat[rows.long(), cols.long()] = 1.0 if values is None else values.to(grad.dtype)
        product = grad.t().mm(flat)
        return product if target is None else target.add_(product)
    order = column_order(cols, n_in)
    counts = torch.bincount(cols, minlength=n_in)
    rows = rows[order]
    offsets = (counts.cumsum(0) - counts).to(rows.dtype)
    weights = None if values is None else values[order]
    add = target is not None
    if target is None:
        # a weight of up to `KEEP_ELEMENTS` sums in the transposed layout (an (out, in) view
        # of (in, out) rows): each block adds into contiguous runs of its rows, not across
        # strides; the one copy into .grad's layout comes at the end, at most 1 MiB
        small = out * n_in <= KEEP_ELEMENTS
        target = grad.new_empty(n_in, out).t() if small else grad.new_empty(out, n_in)
    step = max(1, GATHER_BLOCK // max(1, n_in))
    for o0 in range(0, out, step):
        part = nn.functional.embedding_bag(
            rows, grad[:, o0 : o0 + step].contiguous(), offsets, mode="sum",
            per_sample_weights=weights,
        )  # fmt: skip
        rows_of = target[o0 : o0 + step].t()
        if add:
            rows_of.add_(part)
        else:
            rows_of.copy_(part)
        del part
    return target


class GatherLinear(torch.autograd.Function):
    """``flat @ weight.T + bias`` for a ``flat (rows, in)`` input given by its non-zeros
    (``rows``, ``cols`` ascending row-major, ``values`` or None for ones), differentiable with
    respect to the weight and bias (`gather`, `gather_weight_grad`); the weight gradient goes
    into the engine's running sum when it offers a `GradSink`. The input needs no gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        weight: Tensor,
        bias: Tensor | None,
        n_rows: int,
        rows: Tensor,
        cols: Tensor,
        values: Tensor | None,
        sink: GradSink | None,
        transposed: Tensor | None,
    ) -> Tensor:
        z = gather(weight, n_rows, rows, cols, values, transposed)
        if bias is not None:
            z.add_(bias)
        ctx.save_for_backward(rows, cols, values)
        ctx.has_bias = bias is not None
        ctx.weight_shape = tuple(weight.shape)
        ctx.sink = sink
        return z

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        rows, cols, values = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[0]:
            sink: GradSink | None = ctx.sink if ctx.sink is not None and ctx.sink.active else None
            target = None if sink is None else sink.target
            target = gather_weight_grad(grad, rows, cols, values, ctx.weight_shape, target)
            if sink is not None:
                sink.target = target
            else:
                grad_w = target
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return grad_w, grad_b, None, None, None, None, None, None


def column_order(cols: Tensor, n_in: int) -> Tensor:
    """``argsort(cols, stable=True)``: on the CPU with fewer than 65,536 columns through
    NumPy's radix sort of 16-bit keys (about 15x faster than torch's sort here)."""
    if cols.device.type == "cpu" and n_in <= 65536:
        keys = cols.numpy().astype(np.uint16)
        return torch.from_numpy(np.argsort(keys, kind="stable").astype(np.int64))
    return torch.argsort(cols, stable=True)
