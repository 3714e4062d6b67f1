"""Exceptions shared by every layer. Pure Python: importing this module never imports torch."""

from __future__ import annotations


class SpikeckptError(Exception):
    """Base class of every error spikeckpt raises on purpose."""


class ScheduleError(SpikeckptError, ValueError):
    """A schedule is broken: the message names the offending action and its position."""


class BudgetTooSmall(SpikeckptError, ValueError):
    """No plan fits the device memory budget.

    Attributes:
        budget_bytes: the budget that was asked for (bytes).
        minimum_bytes: the smallest budget that some plan would fit in (bytes).
    """

    def __init__(self, message: str, *, budget_bytes: int, minimum_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes


class UnsupportedLayerError(SpikeckptError, TypeError):
    """A model contains a layer that cannot be stepped one time step at a time."""


class NotBinaryError(SpikeckptError, ValueError):
    """A tensor that must hold spikes (exactly 0 or 1) holds other values."""


class StorageError(SpikeckptError, OSError):
    """A storage tier cannot hold a checkpoint (disk full, folder not writable, ...)."""


class UnlistedParamsError(SpikeckptError, ValueError):
    """A step uses tensors that require grad but are not among the tensors the engine
    differentiates: they would get no gradient. The message names their shapes (and the layer
    where it is known) and the fix: ``scan(..., params=[...])`` / ``wrap(..., params=[...])``.

    Attributes:
        tensors: the tensors found (leaves of the step's autograd graph).
    """

    def __init__(self, message: str, tensors: list[object] | None = None) -> None:
        super().__init__(message)
        self.tensors = list(tensors or [])
