"""Parameter gradient sums that autograd adds into in place, as early as it can.

Within one backward call autograd sums a parameter's contributions in a buffer, in place
only when the buffer holds a plain tensor that nothing else references. A ``Linear``'s
weight gradient arrives as a view (``TBackward0`` hands on ``mm(...).t()``), so the first
two contributions were summed out of place: three weight-sized tensors at once (measured:
48.6 MiB for a ``Linear(2048, 2048)`` used at 6 steps; the plain loop holds the same). Here
the first contribution of each parameter is handed on as a plain tensor over the same memory
(`plain`), so every later one is added into it: 32.8 MiB, the same values bit for bit (the
same additions in the same order), in the parameter's layout.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["FIRST_USE_NODES", "plain", "sum_in_place_from_first"]

#: graph nodes searched (newest first) for the nodes that hand on the parameters' first
#: contributions; a parameter not reached within them is summed as autograd does
FIRST_USE_NODES = 256


def plain(grad: Tensor | None) -> Tensor | None:
    """``grad`` as a tensor autograd may add into in place: a view covering all of its base
    (``mm(...).t()``) becomes a plain tensor over the same memory (no copy); anything else is
    returned as it is. The base's storage is not asked for: a Python handle on it would count
    as one more reference, and autograd would add out of place again."""
    if grad is None or grad._base is None or grad.layout != torch.strided:
        return grad
    if grad.storage_offset() != 0 or grad._base.numel() != grad.numel():
        return grad
    return grad.detach()


def _plain_slots(slots: tuple[int, ...], grad_inputs: tuple[Any, ...], _outs: Any) -> Any:
    """Post-hook of a node that hands a parameter its first contribution: the gradients at
    ``slots`` made `plain`."""
    grads = list(grad_inputs)
    for i in slots:
        grads[i] = plain(grads[i])
    return tuple(grads)


def sum_in_place_from_first(
    roots: Sequence[Tensor], params: Sequence[Tensor], limit: int = FIRST_USE_NODES
) -> None:
    """Before backpropagating ``roots``: for each of ``params`` (tensors with no running sum
    yet), find the node whose contribution autograd hands it first (the newest node using it:
    autograd runs nodes newest first) and make that contribution `plain`, so that the later
    ones are added into it in place. Searches at most ``limit`` nodes, newest first."""
    want = {id(p) for p in params}
    heap: list[tuple[int, int, Any]] = []
    for root in roots:
        node = root.grad_fn
        if node is not None:
            heapq.heappush(heap, (-node._sequence_nr(), len(heap), node))
    kept: list[Any] = []  # node wrappers may be transient: keep them alive, ids unique
    seen: set[int] = set()
    pushed = len(heap)
    while heap and want and len(kept) < limit:
        node = heapq.heappop(heap)[2]
        if id(node) in seen:
            continue
        kept.append(node)
        seen.add(id(node))
        slots = []
        for i, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)
            if variable is None:
                pushed += 1
                heapq.heappush(heap, (-nxt._sequence_nr(), pushed, nxt))
            elif id(variable) in want:
                want.discard(id(variable))
                slots.append(i)
        if slots:
            try:
                node.register_hook(functools.partial(_plain_slots, tuple(slots)))
            except (RuntimeError, TypeError):  # a node without hooks: summed as autograd does
                continue
