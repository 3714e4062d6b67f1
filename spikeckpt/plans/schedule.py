"""Schedules as data: the action vocabulary every plan emits and every executor runs.

Indexing convention: ``x_i`` is the state *before* step ``i``; step ``i`` maps ``x_i`` to
``x_{i+1}`` using input ``i`` and emits output ``y_i``. ``x_0`` is the initial state and ``x_T``
the final one. A schedule is one sequence of actions. Its **forward phase** is everything
before the first [`Backprop`][spikeckpt.plans.schedule.Backprop]: it must evaluate steps ``0 .. T-1`` once each, in order
(these evaluations emit the outputs). Everything after is the **backward phase**:
recomputation and backpropagation, walking the gradient from ``x_T`` back to ``x_0``.

Tiers are ``"device"`` (where the step runs) and ``"remote"`` (host RAM or disk: which one is
the executor's choice, not the plan's).

Long schedules are **compact**: a plan's schedule holds [`Block`][spikeckpt.plans.schedule.Block] parts that expand
lazily into actions, so a schedule for ``T = 10**6`` takes a few kilobytes, not gigabytes.
Iterating a schedule (``for action in schedule``, ``schedule.forward``,
``schedule.backward``) yields plain actions either way, and the simulator validates a block
shape once and reuses the result wherever the same shape recurs.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice, zip_longest
from typing import Any, Literal

Tier = Literal["device", "remote"]
TIERS: tuple[Tier, ...] = ("device", "remote")


@dataclass(frozen=True, slots=True)
class Advance:
    """Run steps ``start .. stop-1`` without a tape, from the current state ``x_start``."""

    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Tape:
    """Run steps ``start .. stop-1`` recording the autograd tape; keep it for a later Backprop."""

    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Backprop:
    """Backpropagate the taped steps ``start .. stop-1``.

    Consumes the gradient of ``x_stop`` (and of the outputs ``y_start .. y_stop-1``) and leaves
    the gradient of ``x_start``. Afterwards there is no current state: the next step needs a
    Load.
    """

    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Store:
    """Keep the current state ``x_index`` in ``tier`` (a remote store is a write off the device)."""

    index: int
    tier: Tier


@dataclass(frozen=True, slots=True)
class Load:
    """Make the stored ``x_index`` from ``tier`` the current state (uses a prefetched copy)."""

    index: int
    tier: Tier


@dataclass(frozen=True, slots=True)
class Free:
    """Drop the stored ``x_index`` from ``tier``."""

    index: int
    tier: Tier


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Start copying the remote ``x_index`` to a device buffer; a later remote Load uses it."""

    index: int


Action = Advance | Tape | Backprop | Store | Load | Free | Prefetch
ACTION_TYPES: frozenset[type] = frozenset({Advance, Tape, Backprop, Store, Load, Free, Prefetch})


@dataclass(frozen=True, slots=True)
class Boundary:
    """What a [`Block`][spikeckpt.plans.schedule.Block] expects to find (``entry``) and leaves behind (``exit``).

    Offsets are relative to the block's ``start``. ``current`` is the offset of the current
    state (None: the block does not use it at entry; at exit, None means the block ends with
    a Backprop). ``stored`` holds ``(offset, tier)`` pairs, ``prefetched`` offsets.
    """

    current: int | None = None
    stored: frozenset[tuple[int, Tier]] = frozenset()
    prefetched: frozenset[int] = frozenset()
    #: more stored states, as ``(first, stop, step, tier)`` ranges of offsets inside the block
    runs: tuple[tuple[int, int, int, Tier], ...] = ()


class Block:
    """A piece of a schedule over steps ``start .. stop-1`` that expands lazily.

    Subclasses are frozen dataclasses with ``start`` and ``stop`` fields. [`parts`][spikeckpt.plans.schedule.Block.parts]
    yields actions and smaller blocks. A block either reverses its steps (it ends with the
    Backprop that leaves the gradient at ``x_start``; ``exit.current`` is None) or is a
    forward stretch without backpropagation that ends on ``x_{start + exit.current}``.
    Besides its ``entry`` and ``exit`` boundary states it stores and prefetches only states
    ``x_start .. x_stop-1``.

    ``key`` describes the block's shape: two blocks with the same (non-None) key yield the
    same actions shifted by the difference of their starts. The simulator validates each
    shape once and reuses the counts; ``key = None`` only makes the expansion lazy.
    """

    __slots__ = ()
    start: int
    stop: int

    @property
    def key(self) -> Hashable | None:
        """The translation-invariant shape of this block, or None (never reused)."""
        return None

    @property
    def entry(self) -> Boundary:
        """The states the block needs before its first action."""
        return Boundary()

    @property
    def exit(self) -> Boundary:
        """The states the block leaves after its last action."""
        return Boundary()

    def parts(self) -> Iterator[Action | Block]:
        """The block's actions and sub-blocks, in order."""
        raise NotImplementedError


def flatten(parts: Iterable[Action | Block]) -> Iterator[Action]:
    """Yield the plain actions of ``parts``, expanding blocks depth first (memory: the depth).

    Anything that is neither an action nor a [`Block`][spikeckpt.plans.schedule.Block] is yielded as it is (the
    simulator then rejects it by name).
    """
    stack: list[Iterator[Any]] = [iter(parts)]
    actions = ACTION_TYPES
    while stack:
        for item in stack[-1]:
            if type(item) in actions or not isinstance(item, Block):
                yield item
            else:
                stack.append(iter(item.parts()))
                break
        else:
            stack.pop()


class _Phase:
    """A lazy, re-iterable view of one phase of a schedule (see [`Schedule.forward`][spikeckpt.plans.schedule.Schedule.forward])."""

    __slots__ = ("_schedule", "_forward")

    def __init__(self, schedule: Schedule, forward: bool) -> None:
        self._schedule = schedule
        self._forward = forward

    def __iter__(self) -> Iterator[Action]:
        actions = flatten(self._schedule.parts)
        if self._forward:
            for action in actions:
                if type(action) is Backprop:
                    return
                yield action
            return
        for action in actions:
            if type(action) is Backprop:
                yield action
                break
        yield from actions

    def __len__(self) -> int:
        count = 0
        for _ in self:
            count += 1
        return count

    def __getitem__(self, position: int) -> Action:
        return _at(self, position)

    def __repr__(self) -> str:
        return f"<{'forward' if self._forward else 'backward'} phase of {self._schedule!r}>"


def _at(actions: Any, position: int) -> Action:
    if position < 0:
        position += len(actions)
    if position < 0:
        raise IndexError("schedule index out of range")
    for action in islice(actions, position, None):
        return action
    raise IndexError("schedule index out of range")


class Schedule:
    """A plan's schedule for ``T`` steps: an immutable, lazily expanded sequence of actions.

    Iterating yields the actions in execution order; ``len()`` and indexing work too, but
    they walk the actions (on a compact schedule of millions of actions, prefer iterating).

    Attributes:
        T: number of time steps.
        plan: a short description of the plan that made it (for messages and tables).
        parts: the compact form: actions and [`Block`][spikeckpt.plans.schedule.Block] parts, in order.
    """

    __slots__ = ("T", "plan", "parts", "_length")
    T: int
    plan: str
    parts: tuple[Action | Block, ...]
    _length: int | None

    def __init__(
        self, T: int, actions: Iterable[Action | Block] = (), plan: str = "custom"
    ) -> None:
        object.__setattr__(self, "T", T)
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "parts", tuple(actions))
        object.__setattr__(self, "_length", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Schedule is immutable; cannot set {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Schedule, (self.T, self.parts, self.plan))

    def __iter__(self) -> Iterator[Action]:
        return flatten(self.parts)

    def __len__(self) -> int:
        if self._length is None:
            count = 0
            for _ in self:
                count += 1
            object.__setattr__(self, "_length", count)
            return count
        return self._length

    def __getitem__(self, position: int) -> Action:
        return _at(self, position)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        if (self.T, self.plan) != (other.T, other.plan):
            return False
        if self.parts == other.parts:
            return True
        marker = object()
        return all(a == b for a, b in zip_longest(self, other, fillvalue=marker))

    def __hash__(self) -> int:
        return hash((self.T, self.plan))

    def __repr__(self) -> str:
        return f"Schedule(T={self.T}, plan={self.plan!r}, parts={len(self.parts)})"

    @property
    def actions(self) -> tuple[Action, ...]:
        """Every action, materialized as a tuple (memory grows with the number of actions)."""
        return tuple(self)

    @property
    def forward_length(self) -> int:
        """Number of actions in the forward phase (all actions before the first Backprop)."""
        return len(self.forward)

    @property
    def forward(self) -> _Phase:
        """The forward-phase actions: a lazy view, iterated afresh each time."""
        return _Phase(self, True)

    @property
    def backward(self) -> _Phase:
        """The backward-phase actions (recomputation and backpropagation): a lazy view."""
        return _Phase(self, False)


def make_schedule(T: int, actions: Sequence[Action], plan: str = "custom") -> Schedule:
    """Build a [`Schedule`][spikeckpt.plans.schedule.Schedule] from any sequence of actions."""
    return Schedule(T, tuple(actions), plan)
