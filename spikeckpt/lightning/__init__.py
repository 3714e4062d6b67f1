"""Lightning integration: the :class:`MemoryBudget` callback (needs ``spikeckpt[lightning]``)."""

from spikeckpt.lightning.budget import MemoryBudget

__all__ = ["MemoryBudget"]
