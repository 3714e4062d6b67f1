"""A dispatch mode counting the copies from the CPU to another device (the tests use the
"meta" device in place of a GPU): on CUDA each copy from pageable host memory makes the host
wait until the device's queue is done."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HostToDeviceCopies(TorchDispatchMode):
    """Counts the copy operations that read a CPU tensor and make one on another device."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if "copy" in str(func):
            sources = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            results: list[Any] = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if any(t.device.type == "cpu" for t in sources) and any(
                t.device.type != "cpu" for t in results
            ):
                self.count += 1
        return out
