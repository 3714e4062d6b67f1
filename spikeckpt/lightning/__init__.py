"""Lightning integration: the [`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget] callback (needs ``spikeckpt[lightning]``)."""

from spikeckpt.lightning.budget import MemoryBudget

__all__ = ["MemoryBudget"]
