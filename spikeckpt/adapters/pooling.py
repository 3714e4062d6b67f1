"""``nn.MaxPool2d`` through torch's channels-last kernel, in the step of
`spikeckpt.adapters.generic.StatelessAdapter` (a layer-wise chunk, or a step of the stack).

A convolutional SNN block pools each step's feature maps (``Conv2d -> MaxPool2d -> neuron``).
On the CPU torch's max pooling over a contiguous ``(N, C, H, W)`` tensor walks each output
window in scalar code, where its channels-last kernel compares whole rows of channels at once:
over one chunk of N-MNIST's first block (``160 x 12 x 30 x 30``, one thread) 6.4 ms against
2.6 ms with the copies into and out of that layout. Both kernels take, in each window, the
first largest value in the same scan order (a NaN wins as it comes), so the pooled values and
the positions they came from are the same, bitwise; the positions index each plane the same
way in both layouts. The backward puts each gradient at its position through torch's own
backward in the contiguous layout: where windows do not overlap, every input receives at
most one gradient, so the result is torch's, bitwise, and nothing but the positions is kept
(torch's own backward keeps the input too), as 32-bit integers where a plane's positions fit
(half of torch's 64-bit ones; the conversion replaces the copy into the contiguous layout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

__all__ = ["fast_max_pool"]

_ATEN = torch.ops.aten

Pair = tuple[int, int]

#: the backward's slices of a chunk's rows (see `_MaxPool2d.backward`)
_SLICES = 8


def fast_max_pool(module: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """``module`` through the channels-last kernel (`_MaxPool2d`), or None where it is not
    a plain ``nn.MaxPool2d`` (torch's class and ``forward``) returning values alone over
    windows that do not overlap (stride at least the kernel, no dilation). The function
    returns None for an input it does not take (not a CPU float32 / float64 batch of
    ``(N, C, H, W)``): the caller then calls the module."""
    if type(module) is not nn.MaxPool2d or "forward" in vars(module) or module.return_indices:
        return None
    m: Any = module
    kernel = _pair(m.kernel_size)
    stride = _pair(m.stride) if m.stride is not None else kernel  # torch sets it; a None: kernel
    padding, dilation = _pair(m.padding), _pair(m.dilation)
    if dilation != (1, 1) or any(s < k for s, k in zip(stride, kernel, strict=True)):
        return None
    args = (kernel, stride, padding, dilation, bool(m.ceil_mode))

    def pool(x: Tensor) -> Tensor | None:
        if x.device.type != "cpu" or x.dim() != 4 or x.dtype not in (torch.float32, torch.float64):
            return None
        return _MaxPool2d.apply(x, *args)

    return pool  # type: ignore[return-value]


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
        rows = x.contiguous(memory_format=torch.channels_last)
        y, where = _ATEN.max_pool2d_with_indices(rows, kernel, stride, padding, dilation, ceil_mode)
        del rows
        if ctx.needs_input_grad[0]:
            small = x.shape[-2] * x.shape[-1] <= torch.iinfo(torch.int32).max
            kept = torch.int32 if small else torch.int64
            ctx.save_for_backward(where.to(kept, memory_format=torch.contiguous_format))
        ctx.args = (x.shape, kernel, stride, padding, dilation, ceil_mode)
        return y.contiguous()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (where,) = ctx.saved_tensors
        shape, *args = ctx.args
        g = g.contiguous()
        grad = g.new_empty(shape)  # torch's backward zeroes it, then writes the gradients
        like = g.new_zeros(()).expand(shape)  # read for its shape alone: no memory
        # a slice of the rows at a time: torch's backward reads 64-bit positions, and their
        # copies stay an eighth of the 32-bit ones kept
        step = -(-shape[0] // _SLICES)
        for start in range(0, shape[0], step):
            rows = slice(start, start + step)
            _ATEN.max_pool2d_with_indices_backward.grad_input(
                g[rows], like[rows], *args, where[rows].to(torch.int64), grad_input=grad[rows]
            )
        return grad, None, None, None, None, None
