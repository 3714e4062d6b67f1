"""The GEMM libraries' workspaces on CUDA, allocated before anything is measured.

cuBLAS and cuBLASLt need scratch memory for a matrix product. PyTorch gives each (library
handle, stream) pair one workspace, allocated through the CUDA caching allocator at that
handle's first product and kept until ``torch.cuda.empty_cache()`` frees it (which Lightning
calls when a ``Trainer.fit`` ends): 32 MiB for cuBLAS on Hopper GPUs in torch 2.x
(``CUBLAS_WORKSPACE_CONFIG`` sets it), and handles are per thread, so the forward pass (the
caller's thread) and the backward pass (autograd's worker thread of the device) hold one each.

Allocated inside a measured block, such a workspace is counted as if the step held it: on an
H200 (torch 2.11) the first measured training step of a 100-1024-10 network came out 64 MiB
over the plans. The workspaces belong with the CUDA context (a fixed cost of using the
device, allocated once whatever the plan), so `warm_gemm_workspaces` allocates them before
every CUDA measurement (`spikeckpt.engine.meter.MemoryMeter` calls it): one small product of
each kind on the calling thread, and, the first time or when that product allocated (the
workspaces were freed since: on the H200 the second ``Trainer.fit`` of a process measured 64
MiB over its plans for that reason), the same inside a backward pass. They then exist at every
block's entry and are not counted.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

__all__ = ["warm_gemm_workspaces"]

_WARM: set[tuple[torch.device, int]] = set()
_LOCK = threading.Lock()


def warm_gemm_workspaces(device: torch.device) -> bool:
    """Make sure the cuBLAS and cuBLASLt workspaces on CUDA ``device`` exist for this thread
    and for autograd's worker thread of the device (a few 16 x 16 products; the backward pass
    only the first time per thread or after the workspaces were freed); True when they do,
    False where nothing was done: a device other than CUDA, or a moment when no product may
    run (inference mode, a CUDA graph being captured)."""
    if device.type != "cuda":
        return False
    if torch.is_inference_mode_enabled() or torch.cuda.is_current_stream_capturing():
        return False
    key = (device, threading.get_ident())
    with _LOCK, torch.enable_grad():
        before = torch.cuda.memory_allocated(device)
        _products(device)  # this thread's handles; allocates only where a workspace is missing
        if key in _WARM and torch.cuda.memory_allocated(device) == before:
            return True
        seed = torch.zeros(1, device=device, requires_grad=True)
        _InBackward.apply(seed).sum().backward()  # the autograd worker thread's handles
        torch.cuda.synchronize(device)
        _WARM.add(key)
    return True


def _products(device: torch.device) -> None:
    """One small product of each kind the libraries serve: cuBLAS (``mm``), cuBLASLt (``addmm``
    with a bias, its epilogue path) and the half-precision types where the device has them."""
    a = torch.ones(16, 16, device=device)
    torch.mm(a, a)
    torch.addmm(a[0], a, a)
    for dtype in (torch.float16, torch.bfloat16):
        if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            continue
        h = a.to(dtype)
        torch.mm(h, h)
        torch.addmm(h[0], h, h)


class _InBackward(torch.autograd.Function):
    """Identity whose backward runs `_products` (on autograd's worker thread of the device)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        _products(grad.device)
        return grad
