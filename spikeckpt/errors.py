"""Exceptions shared by every layer. Pure Python: importing this module never imports torch.

Every error spikeckpt raises on purpose is a [`SpikeckptError`][spikeckpt.errors.SpikeckptError]; each class is also the
built-in exception it stands for (a bad value is a ``ValueError``, a wrong type a
``TypeError``), so ``except ValueError`` keeps working. ``tests/test_errors.py`` reads every
``raise`` statement of the package and holds it to this.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence


class SpikeckptError(Exception):
    """Base class of every error spikeckpt raises on purpose."""


class ConfigError(SpikeckptError, ValueError):
    """An argument or setting has a value spikeckpt does not accept, or a step or model gave
    something it cannot run (a state whose shape changed, ...): the message names it and the
    fix."""


class ConfigTypeError(SpikeckptError, TypeError):
    """An argument (or what a step returned) has a type spikeckpt does not accept, or a
    keyword it does not know: the message names it and the fix."""


class UsageError(SpikeckptError, RuntimeError):
    """An operation that cannot run now: a second backward through one run, a closed store,
    a meter used twice at once, a run that cannot go on."""


class ScheduleError(SpikeckptError, ValueError):
    """A schedule is broken: the message names the offending action and its position."""


class BudgetTooSmall(SpikeckptError, ValueError):
    """No plan fits the device memory budget (or the plan given cannot keep it).

    Attributes:
        budget_bytes: the budget that was asked for (bytes).
        minimum_bytes: the smallest budget that some plan would fit in (bytes); passed back
            as the budget, it works.
    """

    def __init__(self, message: str, *, budget_bytes: int, minimum_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes


class SlowPlanWarning(UserWarning):
    """The budget leaves room only for a stack plan that recomputes its steps many times over
    (modeled more than 3x BPTT's time, `SLOW_FACTOR`); the message names a budget that
    runs within it. Silence it with ``warnings.filterwarnings("ignore",
    category=spikeckpt.SlowPlanWarning)``."""


class UnsupportedLayerError(SpikeckptError, TypeError):
    """A model contains a layer that cannot be stepped one time step at a time."""


class NotBinaryError(SpikeckptError, ValueError):
    """A tensor that must hold spikes (exactly 0 or 1) holds other values."""


class StorageError(SpikeckptError, OSError):
    """A storage tier cannot hold a checkpoint (disk full, folder not writable, ...)."""


class MissingDependencyError(SpikeckptError, ModuleNotFoundError):
    """An optional package a feature needs is not installed: the message names the extra to
    install (``pip install "spikeckpt[data]"``)."""


class UnlistedParamsError(SpikeckptError, ValueError):
    """A step uses tensors that require grad but are not among the tensors the engine
    differentiates: they would get no gradient. The message names their shapes (and the layer
    where it is known) and the fix: ``scan(..., params=[...])`` / ``wrap(..., params=[...])``.

    Attributes:
        tensors: the tensors found (leaves of the step's autograd graph).
    """

    def __init__(self, message: str, tensors: Sequence[object] | None = None) -> None:
        super().__init__(message)
        self.tensors = list(tensors or [])


#: the packages whose frames a warning skips to reach the line of yours that led to it
_LIBRARY_FRAMES = (
    "spikeckpt",
    "torch",
    "lightning",
    "pytorch_lightning",
    "contextlib",
    "functools",
)


def warn_in_callers_code(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the first frame outside spikeckpt, torch and Lightning
    (your ``model(x)``, ``scan(...)`` or ``trainer.fit(...)``), not at the planner's line
    (``stacklevel`` counted from where it is called)."""
    frame = sys._getframe(1)
    level = 2
    while frame is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] in (
        _LIBRARY_FRAMES
    ):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)
