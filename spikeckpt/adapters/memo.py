"""`TensorMemo`: values derived from a tensor, kept until the tensor changes or dies.

Keyed by the tensor's identity (``id``, with a weak reference to tell a reused id) and its
version counter, not by the tensor itself: a ``WeakKeyDictionary`` compares its keys with
``==``, which reads the values (on CUDA, a device sync per lookup).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from torch import Tensor

__all__ = ["TensorMemo"]

V = TypeVar("V")


class TensorMemo(Generic[V]):
    """``make(tensor)`` computed once per tensor, extra key and version (an in-place change
    makes it again); an entry goes when its tensor is freed."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, Hashable], tuple[weakref.ref[Tensor], int, V]] = {}

    def get(self, tensor: Tensor, make: Callable[[Tensor], V], key: Hashable = None) -> V:
        """The value of ``make(tensor)`` for ``key``, made at the first call or after the
        tensor changed."""
        slot = (id(tensor), key)
        known = self._known.get(slot)
        if known is None or known[0]() is not tensor or known[1] != tensor._version:
            known = (
                weakref.ref(tensor, lambda _: self._known.pop(slot, None)),
                tensor._version,
                make(tensor),
            )
            self._known[slot] = known
        return known[2]

    def forget(self, tensor: Tensor, key: Hashable = None) -> None:
        """Drop ``tensor``'s value for ``key``: the next `get` makes it again (a write through
        ``tensor.data`` changes the values and keeps the version counter)."""
        self._known.pop((id(tensor), key), None)
