"""Best-fit reuse of freed regions: pinned host buffers (host tier), file regions (disk tier)."""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["ALIGN", "BestFit", "round_capacity"]

ALIGN = 64
"""Bytes: every capacity is a multiple of this."""

Region = TypeVar("Region")


def round_capacity(nbytes: int) -> int:
    """Bytes to reserve for ``nbytes``: rounded up to 1/8 of a power of two (at most 12.5%
    more) and to `ALIGN`, so that the sizes of similar requests recur."""
    step = max(ALIGN, 1 << max(0, nbytes.bit_length() - 4))
    return max(step, -(-nbytes // step) * step)


class BestFit(Generic[Region]):
    """Freed regions (a buffer, a file offset) and their capacities in bytes.

    ``take(nbytes)`` returns the smallest freed region that holds ``nbytes`` and is at most
    about twice as large (``capacity <= 2 * nbytes + 4096``), so a small request does not pin
    a large region; None when there is none.
    """

    def __init__(self) -> None:
        self._free: list[tuple[int, Region]] = []

    def take(self, nbytes: int) -> tuple[int, Region] | None:
        """``(capacity, region)`` of the best freed region for ``nbytes``, or None."""
        best = -1
        for i, (capacity, _) in enumerate(self._free):
            if nbytes <= capacity <= 2 * nbytes + 4096 and (
                best < 0 or capacity < self._free[best][0]
            ):
                best = i
        return None if best < 0 else self._free.pop(best)

    def give(self, capacity: int, region: Region) -> None:
        """Make ``region`` (``capacity`` bytes) available again."""
        self._free.append((capacity, region))

    def clear(self) -> None:
        self._free.clear()

    def __len__(self) -> int:
        return len(self._free)
