"""Autocast's state, asked only of the device types that have autocast.

``torch.is_autocast_enabled(kind)`` raises for a device type without autocast (the "meta"
device, some out-of-tree backends); such a device runs every op in its given dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["autocast_kinds", "autocast_on", "cached_cast_bytes"]


def autocast_kinds(device: torch.device) -> tuple[str, ...]:
    """The device types whose autocast state a run on ``device`` depends on: the CPU's and
    ``device``'s own, where it has autocast."""
    kinds = dict.fromkeys((device.type, "cpu"))
    return tuple(kind for kind in kinds if torch.amp.is_autocast_available(kind))


def autocast_on(device: torch.device) -> bool:
    """Whether autocast is on for the CPU or for ``device``'s type."""
    return any(torch.is_autocast_enabled(kind) for kind in autocast_kinds(device))


def cached_cast_bytes(params: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the reduced-precision copies of ``params`` that autocast keeps in its cache
    while it is on (cache enabled): one per float32 leaf requiring grad on a device type
    whose autocast is on, at that autocast's dtype; 0 with autocast off. They are made by the
    first op that casts the parameter and held until the outermost autocast region exits (the
    whole forward, the backward that follows it inside the region): beside every chunk.
    A bound: a parameter that only a float32 op reads is never cast."""
    if not torch.is_autocast_cache_enabled():
        return 0
    total = 0
    for kind in autocast_kinds(device):
        if not torch.is_autocast_enabled(kind):
            continue
        size = torch.get_autocast_dtype(kind).itemsize
        total += sum(
            p.numel() * size
            for p in params
            if p.device.type == kind and p.dtype == torch.float32 and p.requires_grad and p.is_leaf
        )
    return total
