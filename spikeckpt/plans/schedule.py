"""Schedules as data: the action vocabulary every plan emits and every executor runs.

Indexing convention: ``x_i`` is the state *before* step ``i``; step ``i`` maps ``x_i`` to
``x_{i+1}`` using input ``i`` and emits output ``y_i``. ``x_0`` is the initial state and ``x_T``
the final one. A schedule is one list of actions. Its **forward phase** is everything before
the first :class:`Backprop`: it must evaluate steps ``0 .. T-1`` once each, in order (these
evaluations emit the outputs). Everything after is the **backward phase**: recomputation and
backpropagation, walking the gradient from ``x_T`` back to ``x_0``.

Tiers are ``"device"`` (where the step runs) and ``"remote"`` (host RAM or disk: which one is
the executor's choice, not the plan's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

Tier = Literal["device", "remote"]
TIERS: tuple[Tier, ...] = ("device", "remote")


@dataclass(frozen=True)
class Advance:
    """Run steps ``start .. stop-1`` without a tape, from the current state ``x_start``."""

    start: int
    stop: int


@dataclass(frozen=True)
class Tape:
    """Run steps ``start .. stop-1`` recording the autograd tape; keep it for a later Backprop."""

    start: int
    stop: int


@dataclass(frozen=True)
class Backprop:
    """Backpropagate the taped steps ``start .. stop-1``.

    Consumes the gradient of ``x_stop`` (and of the outputs ``y_start .. y_stop-1``) and leaves
    the gradient of ``x_start``. Afterwards there is no current state: the next step needs a
    Load.
    """

    start: int
    stop: int


@dataclass(frozen=True)
class Store:
    """Keep the current state ``x_index`` in ``tier`` (a remote store is a write off the device)."""

    index: int
    tier: Tier


@dataclass(frozen=True)
class Load:
    """Make the stored ``x_index`` from ``tier`` the current state (uses a prefetched copy)."""

    index: int
    tier: Tier


@dataclass(frozen=True)
class Free:
    """Drop the stored ``x_index`` from ``tier``."""

    index: int
    tier: Tier


@dataclass(frozen=True)
class Prefetch:
    """Start copying the remote ``x_index`` to a device buffer; a later remote Load uses it."""

    index: int


Action = Advance | Tape | Backprop | Store | Load | Free | Prefetch


@dataclass(frozen=True)
class Schedule:
    """A plan's schedule for ``T`` steps: an immutable sequence of actions.

    Attributes:
        T: number of time steps.
        actions: the actions, in execution order.
        plan: a short description of the plan that made it (for messages and tables).
    """

    T: int
    actions: tuple[Action, ...]
    plan: str = "custom"

    def __iter__(self) -> Iterator[Action]:
        return iter(self.actions)

    def __len__(self) -> int:
        return len(self.actions)

    def __getitem__(self, position: int) -> Action:
        return self.actions[position]

    @property
    def forward_length(self) -> int:
        """Number of actions in the forward phase (all actions before the first Backprop)."""
        for position, action in enumerate(self.actions):
            if isinstance(action, Backprop):
                return position
        return len(self.actions)

    @property
    def forward(self) -> tuple[Action, ...]:
        """The forward-phase actions."""
        return self.actions[: self.forward_length]

    @property
    def backward(self) -> tuple[Action, ...]:
        """The backward-phase actions (recomputation and backpropagation)."""
        return self.actions[self.forward_length :]


def make_schedule(T: int, actions: Sequence[Action], plan: str = "custom") -> Schedule:
    """Build a :class:`Schedule` from any sequence of actions."""
    return Schedule(T=T, actions=tuple(actions), plan=plan)
