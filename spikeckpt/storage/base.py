"""The interface every storage tier implements, and the ledger that counts bytes per tier.

A tier holds checkpoints: flat lists of tensors (the leaves of one state, plus anything the
executor wants to keep with it) under integer keys (the state index ``i`` of ``x_i``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from spikeckpt.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

TIER_KINDS = ("device", "host", "disk")


@dataclass
class Ledger:
    """Current and peak bytes per tier, and bytes moved.

    All numbers are bytes. ``current[tier]`` is what the tier holds now, ``peak[tier]`` the most
    it held, ``written[tier]`` / ``read[tier]`` the bytes copied into / out of it.
    """

    current: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)
    read: dict[str, int] = field(default_factory=dict)

    def add(self, tier: str, nbytes: int) -> None:
        """Count ``nbytes`` more held in ``tier``."""
        now = self.current.get(tier, 0) + nbytes
        self.current[tier] = now
        self.peak[tier] = max(self.peak.get(tier, 0), now)

    def remove(self, tier: str, nbytes: int) -> None:
        """Count ``nbytes`` fewer held in ``tier``."""
        self.current[tier] = self.current.get(tier, 0) - nbytes

    def moved(self, tier: str, *, written: int = 0, read: int = 0) -> None:
        """Count bytes copied into (``written``) or out of (``read``) ``tier``."""
        self.written[tier] = self.written.get(tier, 0) + written
        self.read[tier] = self.read.get(tier, 0) + read


@runtime_checkable
class StateStore(Protocol):
    """One storage tier. Implementations: device (references), host (CPU RAM), disk (files)."""

    kind: str

    def put(self, key: int, tensors: Sequence[Tensor]) -> None:
        """Store copies (or, for the device tier, references) of ``tensors`` under ``key``."""
        ...

    def get(self, key: int) -> list[Tensor]:
        """Return the tensors stored under ``key`` on the compute device, exactly as stored."""
        ...

    def prefetch(self, key: int) -> None:
        """Start bringing ``key`` back to the compute device; ``get`` then waits for it."""
        ...

    def drop(self, key: int) -> None:
        """Forget ``key`` and release its memory or files."""
        ...

    def close(self) -> None:
        """Release everything (files, threads, buffers). Idempotent; safe on errors."""
        ...


def tensor_nbytes(tensor: Tensor) -> int:
    """Bytes of ``tensor``'s elements (numel * element size; a view counts only its elements)."""
    return tensor.numel() * tensor.element_size()


class StoreBase:
    """Bookkeeping shared by the tiers: open/closed state and clear errors for unknown keys."""

    kind: str = ""
    _closed: bool = False

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"the {self.kind} store is closed: make a new one")

    def _unknown_key(self, key: int, keys: Sequence[int]) -> KeyError:
        shown = sorted(keys)[:10]
        more = ", ..." if len(keys) > 10 else ""
        return KeyError(
            f"no checkpoint {key} in the {self.kind} tier (it holds {len(keys)}: {shown}{more})"
        )
