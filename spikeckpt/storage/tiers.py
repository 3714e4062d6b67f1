"""Storage tiers for checkpoints: device (references), host (CPU RAM, packed), disk (files).

Every tier implements ``spikeckpt.storage.base.StateStore`` and counts, in its ``Ledger``, the
bytes it holds (``ledger.add/remove(kind, nbytes)``) and, for host and disk, the bytes copied
into and out of it (``ledger.moved``). Counted bytes are payload bytes after packing (see
``spikeckpt.storage.codecs``); containers and file headers are not counted.

Keys are ints (state indices). ``put`` on a key already stored replaces it. ``get`` and
``prefetch`` of an unknown key raise ``KeyError``; ``drop`` of an unknown key does nothing.
After ``close`` the store holds nothing and ``put``/``get``/``prefetch`` raise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from spikeckpt.storage.base import TIER_KINDS, Ledger, StateStore, StoreBase, tensor_nbytes
from spikeckpt.storage.disk import DiskStore
from spikeckpt.storage.host import HostStore

__all__ = ["DeviceStore", "DiskStore", "HostStore", "make_store"]


def make_store(
    kind: str,
    device: torch.device | str,
    ledger: Ledger,
    directory: str | os.PathLike[str] | None = None,
) -> StateStore:
    """Build the tier named ``kind`` (``"device"``, ``"host"`` or ``"disk"``) for ``device``.

    ``directory`` (disk only) is the folder under which the disk tier makes its own temporary
    folder; default: the system temporary folder.
    """
    if kind not in TIER_KINDS:
        raise ValueError(
            f"unknown storage {kind!r}: use one of {', '.join(map(repr, TIER_KINDS))} "
            "(device: keep checkpoints where they are computed; host: CPU RAM; disk: files)"
        )
    if directory is not None and kind != "disk":
        raise ValueError(
            f"directory={str(directory)!r} only applies to storage='disk', not {kind!r}"
        )
    if kind == "device":
        return DeviceStore(device, ledger)
    if kind == "host":
        return HostStore(device, ledger)
    return DiskStore(device, ledger, directory=directory)


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
