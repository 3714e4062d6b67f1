"""Norse's parameter NamedTuples (``cell.p``) on the input's device, as Norse's loop uses them.

No Norse import: the adapters of Norse's cells (`spikeckpt.adapters.norse`,
`spikeckpt.adapters.norse_li_linear`) share it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from spikeckpt.adapters.memo import TensorMemo

__all__ = ["is_namedtuple", "move_params"]


def is_namedtuple(obj: object) -> bool:
    """Whether ``obj`` is a NamedTuple (Norse's parameters and states are)."""
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


#: copies of parameter tensors that need no gradient, per device
_MOVED: TensorMemo[Tensor] = TensorMemo()


def move_params(p: Any, device: torch.device) -> Any:
    """``p`` with its tensors usable on ``device``, each in its own dtype; ``p`` itself if no
    tensor needs to move.

    The dtype is never changed: Norse's own loop uses ``p`` as it is, and a copy in the
    input's dtype rounds otherwise (``dt * tau_mem_inv`` in bf16 is 0.1001, not 0.1: the
    membrane 7e-4 off the loop's under bf16 autocast, 5e-9 in a float64 model). A 0-d CPU
    tensor needing no gradient stays (torch takes it as a scalar beside tensors on any
    device, as Norse's own loop does); another tensor that needs no gradient moves once per
    device and version (a copy per step from pageable host memory would make the host wait
    for the GPU's queue); one that needs a gradient moves at each call (the copy is part of
    that call's graph)."""
    if isinstance(p, Tensor):
        scalar = p.dim() == 0 and p.device.type == "cpu" and not p.requires_grad
        if p.device == device or scalar:
            return p
        if p.requires_grad:
            return p.to(device=device)
        return _MOVED.get(p, lambda t: t.to(device=device), (device,))
    if is_namedtuple(p) or type(p) is tuple:
        fields = [move_params(f, device) for f in p]
        if all(a is b for a, b in zip(fields, p, strict=True)):
            return p
        return type(p)(*fields) if is_namedtuple(p) else tuple(fields)
    return p
