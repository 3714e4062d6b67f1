"""Autocast's state, asked only of the device types that have autocast.

``torch.is_autocast_enabled(kind)`` raises for a device type without autocast (the "meta"
device, some out-of-tree backends); such a device runs every op in its given dtype.
"""

from __future__ import annotations

import torch

__all__ = ["autocast_kinds", "autocast_on"]


def autocast_kinds(device: torch.device) -> tuple[str, ...]:
    """The device types whose autocast state a run on ``device`` depends on: the CPU's and
    ``device``'s own, where it has autocast."""
    kinds = dict.fromkeys((device.type, "cpu"))
    return tuple(kind for kind in kinds if torch.amp.is_autocast_available(kind))


def autocast_on(device: torch.device) -> bool:
    """Whether autocast is on for the CPU or for ``device``'s type."""
    return any(torch.is_autocast_enabled(kind) for kind in autocast_kinds(device))
