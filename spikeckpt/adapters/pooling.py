"""``nn.MaxPool2d`` through torch's channels-last kernel, in the step of
`spikeckpt.adapters.generic.StatelessAdapter` (a layer-wise chunk, or a step of the stack).

A convolutional SNN block pools each step's feature maps (``Conv2d -> MaxPool2d -> neuron``).
On the CPU torch's max pooling over a contiguous ``(N, C, H, W)`` tensor walks each output
window in scalar code, where its channels-last kernel compares whole rows of channels at once:
over one chunk of N-MNIST's first block (``160 x 12 x 30 x 30``, one thread) 6.4 ms against
2.6 ms with the copies into and out of that layout. Both kernels take, in each window, the
first largest value in the same scan order (a NaN wins as it comes), so the pooled values and
the positions they came from are the same, bitwise; the positions index each plane the same
way in both layouts. A layer-wise chunk is pooled a slice of rows at a time (`SLICE_BYTES`),
so the channels-last copy and torch's 64-bit positions stay small beside the chunk (snnTorch's
tutorial 7, layer-wise: a peak of 16.5 MiB where the whole chunk at once took 23.8 MiB), and
only the positions are kept, as 32-bit integers where a plane's positions fit (torch's own
backward keeps the input and 64-bit positions). The backward adds each gradient at its
position into zeros, as torch's does (compiled, `_scatter`; else torch's own backward, a
slice at a time): where windows do not overlap, every input receives at most one gradient,
so the result is torch's, bitwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.utils import _pair

from spikeckpt.adapters import jit_loops

__all__ = ["fast_max_pool"]

_ATEN = torch.ops.aten

Pair = tuple[int, int]

#: bytes of input pooled (and backpropagated) at a time (see `_MaxPool2d`): a whole step
#: of a stack (tutorial 7's 16 x 12 x 30 x 30 floats: 0.7 MiB) in one call, a layer-wise
#: chunk in slices (each call costs about 40 us more)
SLICE_BYTES = 1 << 20


#: the least input taken (elements, channels): below, the Function's fixed cost (about 50
#: us) outweighs the channels-last kernel's gain (1 x 12 x 24 x 24: 72 us against torch's 33;
#: 4 x 12 x 24 x 24 even; 16 x 32 x 10 x 10 162 against 266), and one channel has no rows to
#: compare at once (1 x 1 x 700 x 700: 1.2x torch's time)
MIN_ELEMENTS = 1 << 15
MIN_CHANNELS = 4


def _rows_per_slice(x: Tensor) -> int:
    """Rows of ``x`` ``(N, ...)`` per slice of at most `SLICE_BYTES` (at least one)."""
    row = x[0].numel() * x.element_size()
    return max(1, SLICE_BYTES // max(row, 1))


def fast_max_pool(module: nn.Module) -> Callable[[Tensor], Tensor | None] | None:
    """``module`` through the channels-last kernel (`_MaxPool2d`), or None where it is not
    a plain ``nn.MaxPool2d`` (torch's class and ``forward``) returning values alone over
    windows that do not overlap (stride at least the kernel, no dilation). The function
    returns None for an input it does not take (not a contiguous CPU float32 / float64 batch
    of ``(N, C, H, W)`` with at least `MIN_ELEMENTS` elements and `MIN_CHANNELS` channels: a
    channels-last input keeps torch's channels-last output and gradient, whose sums the layer
    before adds in their order): the caller then calls the module."""
    if type(module) is not nn.MaxPool2d or "forward" in vars(module) or module.return_indices:
        return None
    m: Any = module
    kernel = _pair(m.kernel_size)
    stride = _pair(m.stride) if m.stride is not None else kernel  # torch sets it; a None: kernel
    padding, dilation = _pair(m.padding), _pair(m.dilation)
    if any(len(pair) != 2 for pair in (kernel, stride, padding, dilation)):
        return None  # torch also takes one number in a tuple, or no stride: the module's call
    if dilation != (1, 1) or any(s < k for s, k in zip(stride, kernel, strict=True)):
        return None
    # a partial of a module-level function: an adapter holding it pickles (a closure did not)
    return functools.partial(_pool, args=(kernel, stride, padding, dilation, bool(m.ceil_mode)))


def _pool(x: Tensor, args: tuple[Pair, Pair, Pair, Pair, bool]) -> Tensor | None:
    """`fast_max_pool`'s function: ``x`` pooled by `_MaxPool2d` with ``args``, or None."""
    if x.device.type != "cpu" or x.dim() != 4 or x.dtype not in (torch.float32, torch.float64):
        return None
    if x.numel() < MIN_ELEMENTS or x.shape[1] < MIN_CHANNELS or not x.is_contiguous():
        return None
    out: Tensor = _MaxPool2d.apply(x, *args)
    return out


class _MaxPool2d(torch.autograd.Function):
    """``max_pool2d(x)`` pooled channels-last, returned contiguous; its backward from the
    kept positions alone."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        kernel: Pair,
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        ceil_mode: bool,
    ) -> Tensor:
        args = (kernel, stride, padding, dilation, ceil_mode)
        step = _rows_per_slice(x)
        y: Tensor | None = None
        where: Tensor | None = None
        small = x.shape[-2] * x.shape[-1] <= torch.iinfo(torch.int32).max
        # a slice of the rows at a time: the channels-last copy and torch's 64-bit positions
        # stay within a slice's size
        for start in range(0, x.shape[0], step):
            part = x.narrow(0, start, min(step, x.shape[0] - start))
            part = part.contiguous(memory_format=torch.channels_last)
            y_part, where_part = _ATEN.max_pool2d_with_indices(part, *args)
            if y is None or where is None:  # the outputs' shape is known from the first
                y = y_part.new_empty((x.shape[0], *y_part.shape[1:]))
                kept = torch.int32 if small else torch.int64
                where = where_part.new_empty(y.shape, dtype=kept)
            y.narrow(0, start, part.shape[0]).copy_(y_part)
            where.narrow(0, start, part.shape[0]).copy_(where_part)
        assert y is not None and where is not None  # x has rows (an empty batch: torch's own)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(where)
        ctx.args = (x.shape, *args)
        return y

    @staticmethod
    @once_differentiable
    @torch.compiler.disable  # a compiled step's backward must not trace Numba's first call
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (where,) = ctx.saved_tensors
        shape, *args = ctx.args
        g = g.contiguous().resolve_neg()  # (a negated view has no NumPy array)
        if _scatter_jit is not None:
            grad = g.new_zeros(shape)  # torch's backward: zeros, each gradient added
            planes = shape[0] * shape[1]
            _scatter_jit(
                g.numpy().reshape(planes, -1),
                where.numpy().reshape(planes, -1),
                grad.numpy().reshape(planes, -1),
            )
            return grad, None, None, None, None, None
        grad = g.new_empty(shape)  # torch's backward zeroes it, then writes the gradients
        like = g.new_zeros(()).expand(shape)  # read for its shape alone: no memory
        # a slice of the rows at a time: torch's backward reads 64-bit positions, and their
        # copies stay within a slice's size
        step = _rows_per_slice(like)
        for start in range(0, shape[0], step):
            rows = slice(start, start + step)
            _ATEN.max_pool2d_with_indices_backward.grad_input(
                g[rows], like[rows], *args, where[rows].to(torch.int64), grad_input=grad[rows]
            )
        return grad, None, None, None, None, None


def _scatter(g: np.ndarray, where: np.ndarray, grad: np.ndarray) -> None:  # pragma: no cover
    """torch's max-pool backward on the CPU (``grad[plane, where] += g`` per output, in
    order), reading 32-bit positions: ``g``, ``where`` ``(planes, outputs)``, ``grad``
    ``(planes, H * W)`` zeros."""
    for plane in range(g.shape[0]):
        for out in range(g.shape[1]):
            grad[plane, where[plane, out]] += g[plane, out]


_scatter_jit = jit_loops._jit(_scatter)
