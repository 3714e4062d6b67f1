"""The device tier: checkpoints kept where the step runs, as references (no copy)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spikeckpt.storage.base import Ledger, StoreBase, tensor_nbytes

__all__ = ["DeviceStore"]


class DeviceStore(StoreBase):
    """Keeps references to the tensors (no copy) and counts their bytes.

    ``get`` returns the very tensor objects given to ``put``: do not modify them in place.
    """

    kind = "device"

    def __init__(self, device: torch.device | str, ledger: Ledger) -> None:
        self.device = torch.device(device)
        self.ledger = ledger
        self._items: dict[int, tuple[list[Tensor], int]] = {}

    def put(self, key: int, tensors: Sequence[Tensor]) -> None:
        """Keep references to ``tensors`` under ``key`` (bytes: sum of numel * element size)."""
        self._check_open()
        self.drop(key)
        kept = list(tensors)
        nbytes = sum(tensor_nbytes(t) for t in kept)
        self._items[key] = (kept, nbytes)
        self.ledger.add(self.kind, nbytes)

    def get(self, key: int) -> list[Tensor]:
        """The tensors stored under ``key`` (the same objects)."""
        self._check_open()
        if key not in self._items:
            raise self._unknown_key(key, list(self._items))
        return list(self._items[key][0])

    def prefetch(self, key: int) -> None:
        """Nothing to do: the tensors are already on the device."""
        self._check_open()
        if key not in self._items:
            raise self._unknown_key(key, list(self._items))

    def drop(self, key: int) -> None:
        """Forget ``key`` (no-op when absent)."""
        item = self._items.pop(key, None)
        if item is not None:
            self.ledger.remove(self.kind, item[1])

    def close(self) -> None:
        """Forget everything. Idempotent."""
        for key in list(self._items):
            self.drop(key)
        self._closed = True

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items
