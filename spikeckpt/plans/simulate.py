"""Symbolic execution of a schedule: validates it and counts steps, transfers and peak memory.

Memory convention (documented in docs/concepts): device memory at any moment is
``states * S + taped * A`` where ``states`` counts the device checkpoints, the prefetch buffers
holding remote states, and the current (working) state when it is not itself a stored
checkpoint; ``taped`` counts the steps whose autograd tape is alive. The peak is taken over all
moments of the schedule.

Compact schedules: a [`Block`][spikeckpt.plans.schedule.Block] with a shape key is executed
once per shape (on a machine holding only its declared entry states) and its counts and
relative peaks are reused wherever the same shape recurs, after checking that the states it
expects are there and that nothing else is stored in its range. Any error, or any block that
does not keep to its declared boundary, falls back to executing the plain actions one by one,
so the result (and every error message) is exactly that of the expanded schedule.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

from spikeckpt.errors import ConfigError, ScheduleError
from spikeckpt.plans.schedule import (
    TIERS,
    Action,
    Advance,
    Backprop,
    Block,
    Boundary,
    Free,
    Load,
    Prefetch,
    Schedule,
    Store,
    Tape,
    flatten,
)


@dataclass(frozen=True)
class CostModel:
    """Times of the primitive operations, in any one unit (seconds, or multiples of a step).

    Attributes:
        forward: one step evaluation, taped or not (``c_f``).
        backward: backpropagating one taped step (``c_b``).
        write: one remote write (device -> host/disk) of a state.
        read: one remote read (host/disk -> device) of a state.
        segment: the fixed cost of one ``Backprop`` action (one autograd call over a taped
            segment), whatever the segment's length. 0 by default; on a CPU it is about one
            step evaluation, which is what makes single-step tapes (plain Revolve) slow.
    """

    forward: float = 1.0
    backward: float = 2.0
    write: float = 0.0
    read: float = 0.0
    segment: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "write", "read", "segment"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= value < math.inf
            ):
                raise ConfigError(
                    f"CostModel.{name} must be a finite number >= 0 (time units), got {value!r}"
                )


@dataclass(frozen=True)
class Cost:
    """What a schedule costs: counts, peaks and the modeled time and bytes.

    Attributes:
        T: number of steps.
        forward_steps: every step evaluation, taped or not (forward pass and recomputation).
        backward_steps: backpropagated steps (always ``T`` for a valid schedule).
        peak_device_states: most states on the device at once (checkpoints, prefetch buffers,
            working state).
        peak_taped_steps: most steps taped at once.
        remote_writes: state transfers off the device.
        remote_reads: state transfers onto the device.
        peak_remote_states: most states held in the remote tier at once.
        peak_bytes: peak of ``states * state_bytes + taped * step_bytes`` over the schedule.
        time: ``forward_steps*forward + backward_steps*backward + writes*write + reads*read
            + backprops*segment``.
        state_bytes: the ``S`` used for ``peak_bytes``.
        step_bytes: the ``A`` used for ``peak_bytes``.
        backprops: ``Backprop`` actions (autograd calls), one per taped segment.
    """

    T: int
    forward_steps: int
    backward_steps: int
    peak_device_states: int
    peak_taped_steps: int
    remote_writes: int
    remote_reads: int
    peak_remote_states: int
    peak_bytes: int
    time: float
    state_bytes: int = 1
    step_bytes: int = 1
    backprops: int = 0

    @property
    def recompute_factor(self) -> float:
        """Step evaluations per time step (1.0 for BPTT)."""
        return self.forward_steps / self.T

    def time_factor(self, costs: CostModel) -> float:
        """Modeled time relative to BPTT's ``T * (forward + backward)``."""
        return self.time / (self.T * (costs.forward + costs.backward))


class _NotLocal(Exception):
    """A block touched a state outside its range and boundary: run it as plain actions."""


class _Machine:
    """The simulator's state; one per schedule, plus one per block shape being summarized."""

    __slots__ = (
        "T", "S", "A", "current", "current_stored", "device", "remote", "prefetched", "tapes",
        "taped", "grad_at", "emitted", "in_forward", "forward_steps", "backward_steps",
        "backprops", "writes", "reads", "peak_states", "peak_taped", "peak_remote",
        "peak_bytes", "lo", "hi", "allowed", "depth",
    )  # fmt: skip

    def __init__(self, T: int, S: int, A: int) -> None:
        self.T, self.S, self.A = T, S, A
        self.current: int | None = 0
        self.current_stored = False
        self.device: set[int] = set()
        self.remote: set[int] = set()
        self.prefetched: set[int] = set()
        self.tapes: list[tuple[int, int]] = []
        self.taped = 0
        self.grad_at = 0
        self.emitted = 0
        self.in_forward = True
        self.forward_steps = self.backward_steps = self.backprops = 0
        self.writes = self.reads = 0
        self.peak_states = self.peak_taped = self.peak_remote = self.peak_bytes = 0
        self.lo: int | None = None  # a block's range [lo, hi) and boundary (summaries only)
        self.hi = 0
        self.allowed: frozenset[int] = frozenset()
        self.depth = 0

    def states(self) -> int:
        working = 1 if self.current is not None and not self.current_stored else 0
        return len(self.device) + len(self.prefetched) + working

    def tier(self, tier: str) -> set[int]:
        return self.device if tier == "device" else self.remote

    def local(self, index: int) -> None:
        if self.lo is not None and not self.lo <= index < self.hi and index not in self.allowed:
            raise _NotLocal

    def note(self) -> None:
        states = len(self.device) + len(self.prefetched)
        if self.current is not None and not self.current_stored:
            states += 1
        if states > self.peak_states:
            self.peak_states = states
        if self.taped > self.peak_taped:
            self.peak_taped = self.taped
        if len(self.remote) > self.peak_remote:
            self.peak_remote = len(self.remote)
        used = states * self.S + self.taped * self.A
        if used > self.peak_bytes:
            self.peak_bytes = used

    # -- plain actions -------------------------------------------------------------------

    def run_steps(self, position: int, action: Advance | Tape) -> None:
        a, b = action.start, action.stop
        if not 0 <= a < b <= self.T:
            raise _fail(position, action, f"needs 0 <= start < stop <= T={self.T}")
        if self.current != a:
            where = (
                "no current state (Load one first)" if self.current is None else f"x_{self.current}"
            )
            raise _fail(position, action, f"starts from x_{a} but the current state is {where}")
        if self.in_forward:
            if a != self.emitted:
                raise _fail(
                    position,
                    action,
                    "the forward phase must run every step once in order; "
                    f"next step is {self.emitted}",
                )
            self.emitted = b
        self.forward_steps += b - a
        self.current, self.current_stored = b, False
        if type(action) is Tape:
            self.tapes.append((a, b))
            self.taped += b - a

    def store(self, position: int, action: Store) -> None:
        if action.tier not in TIERS:
            raise _fail(position, action, f"unknown tier {action.tier!r}; use one of {TIERS}")
        if self.current != action.index:
            raise _fail(
                position, action, f"the current state is x_{self.current}, not x_{action.index}"
            )
        held = self.tier(action.tier)
        if action.index in held:
            raise _fail(position, action, f"x_{action.index} is already stored in {action.tier}")
        self.local(action.index)
        held.add(action.index)
        if action.tier == "device":
            self.current_stored = True
        else:
            self.writes += 1

    def load(self, position: int, action: Load) -> None:
        if self.in_forward:
            raise _fail(
                position, action, "a Load before the first Backprop breaks the forward sweep"
            )
        if action.tier not in TIERS:
            raise _fail(position, action, f"unknown tier {action.tier!r}; use one of {TIERS}")
        if action.index not in self.tier(action.tier):
            raise _fail(position, action, f"x_{action.index} was never stored in {action.tier}")
        self.current = action.index
        if action.tier == "device":
            self.current_stored = True
        else:
            self.current_stored = False
            if action.index in self.prefetched:
                self.prefetched.discard(action.index)
            else:
                self.reads += 1

    def free(self, position: int, action: Free) -> None:
        if action.tier not in TIERS or action.index not in self.tier(action.tier):
            raise _fail(position, action, f"x_{action.index} is not stored in {action.tier}")
        self.tier(action.tier).discard(action.index)
        if action.tier == "device" and self.current == action.index:
            self.current_stored = False

    def prefetch(self, position: int, action: Prefetch) -> None:
        if action.index not in self.remote:
            raise _fail(position, action, f"x_{action.index} is not stored in remote")
        if action.index in self.prefetched:
            raise _fail(position, action, f"x_{action.index} is already prefetched")
        self.local(action.index)
        self.prefetched.add(action.index)
        self.reads += 1

    def backprop(self, position: int, action: Backprop) -> None:
        a, b = action.start, action.stop
        if self.in_forward:
            if self.emitted != self.T:
                raise _fail(
                    position,
                    action,
                    f"the forward phase stopped at step {self.emitted}; "
                    f"it must run all T={self.T} steps",
                )
            self.in_forward = False
            self.grad_at = self.T
        if not self.tapes or self.tapes[-1] != (a, b):
            raise _fail(position, action, f"steps {a}..{b - 1} are not the most recent tape")
        if b != self.grad_at:
            raise _fail(position, action, f"the state gradient is at x_{self.grad_at}, not x_{b}")
        self.tapes.pop()
        self.taped -= b - a
        self.backward_steps += b - a
        self.backprops += 1
        self.grad_at = a
        self.current, self.current_stored = None, False

    # -- running -------------------------------------------------------------------------

    def run_flat(self, parts: Iterable[Action | Block]) -> None:
        """Execute every plain action, numbering them for error messages."""
        handlers = _handlers(self)
        note = self.note
        for position, action in enumerate(flatten(parts)):
            handler = handlers.get(type(action))
            if handler is None:
                raise _fail(position, action, "unknown action type")
            handler(position, action)
            note()

    def run(self, parts: Iterable[Action | Block], memo: dict[Hashable, Any]) -> None:
        """Execute ``parts``, reusing block summaries from ``memo`` (positions are not kept).

        Blocks without a reusable summary are expanded in place (an explicit stack, so deep
        nesting costs no recursion); summaries nest at most ``_MAX_DEPTH`` machines deep.
        """
        handlers = _handlers(self)
        note = self.note
        stack: list[Iterator[Any]] = [iter(parts)]
        while stack:
            for item in stack[-1]:
                handler = handlers.get(type(item))
                if handler is not None:
                    handler(-1, item)
                    note()
                elif not isinstance(item, Block):
                    raise _fail(-1, item, "unknown action type")
                elif not self.reuse(item, memo):
                    stack.append(iter(item.parts()))
                    break
            else:
                stack.pop()

    def reuse(self, block: Block, memo: dict[Hashable, Any]) -> bool:
        """Apply ``block``'s summary if it has one that fits here; False: expand it."""
        key = block.key
        if key is None or self.depth >= _MAX_DEPTH:
            return False
        ends_at_T = self.in_forward and block.stop == self.T
        memo_key = (type(block), key, self.in_forward, ends_at_T)
        summary = memo.get(memo_key, _MISSING)
        if summary is _MISSING:
            summary = _summarize(self, block, memo)
            memo[memo_key] = summary
        if summary is None or not _fits(self, block, summary):
            return False
        _apply(self, block, summary)
        return True


#: How many block summaries may be nested (each one is a machine on the call stack).
_MAX_DEPTH = 48
_MISSING = object()


def _handlers(m: _Machine) -> dict[type, Any]:
    return {
        Advance: m.run_steps,
        Tape: m.run_steps,
        Store: m.store,
        Load: m.load,
        Free: m.free,
        Prefetch: m.prefetch,
        Backprop: m.backprop,
    }


def _fail(position: int, action: Action, reason: str) -> ScheduleError:
    return ScheduleError(f"invalid schedule at action {position} ({action!r}): {reason}")


@dataclass(frozen=True)
class _Decl:
    """States a boundary declares in one tier: explicit offsets plus ranges of offsets."""

    explicit: frozenset[int]
    ranges: tuple[tuple[int, int, int], ...]

    @staticmethod
    def of(boundary: Boundary, tier: str) -> _Decl:
        return _Decl(
            frozenset(o for o, t in boundary.stored if t == tier),
            tuple((a, b, c) for a, b, c, t in boundary.runs if t == tier),
        )

    def at(self, start: int) -> Iterable[int]:
        """The absolute indices for a block starting at ``start`` (ranges stay lazy)."""
        explicit = [start + o for o in self.explicit]
        if not self.ranges:
            return explicit
        return chain(explicit, *(range(start + a, start + b, c) for a, b, c in self.ranges))

    def within(self, span: int) -> int:
        """How many declared offsets lie in ``[0, span)`` (explicit ones may lie outside)."""
        inside = {o for o in self.explicit if 0 <= o < span}
        for a, b, c in self.ranges:  # steps are positive
            first = a if a >= 0 else a + (c - 1 - a) // c * c
            inside.update(range(first, min(b, span), c))
        return len(inside)

    def minus(self, other: _Decl) -> _Decl:
        """Declared here and not (as written) in ``other``: conservative for ranges."""
        covered = set(other.explicit)
        for a, b, c in other.ranges:
            covered.update(range(a, b, c))
        ranges = tuple(r for r in self.ranges if r not in other.ranges)
        return _Decl(self.explicit - covered, ranges)


_NO_DECL = _Decl(frozenset(), ())


@dataclass(frozen=True)
class _Summary:
    """What one block shape does, relative to its start (see `_summarize`)."""

    entry_current: int | None
    current_stored: bool
    exit_current: int | None
    exit_current_stored: bool
    emitted: int
    entry: dict[str, _Decl]  # "device", "remote", "prefetched"
    exit: dict[str, _Decl]
    created: dict[str, _Decl]  # exit states the entry does not declare
    inside: dict[str, int]  # entry-declared states inside [start, stop), per set
    boundary: tuple[int, ...]  # declared offsets outside [start, stop)
    entry_states: int
    entry_remote: int
    forward_steps: int
    backward_steps: int
    backprops: int
    writes: int
    reads: int
    peak_states: int
    peak_taped: int
    peak_remote: int
    peak_bytes: int


_SETS = ("device", "remote", "prefetched")


def _decls(boundary: Boundary) -> dict[str, _Decl]:
    return {
        "device": _Decl.of(boundary, "device"),
        "remote": _Decl.of(boundary, "remote"),
        "prefetched": _Decl(frozenset(boundary.prefetched), ()),
    }


def _held(m: _Machine, name: str) -> set[int]:
    return m.device if name == "device" else m.remote if name == "remote" else m.prefetched


def _summarize(outer: _Machine, block: Block, memo: dict[Hashable, Any]) -> _Summary | None:
    """Run ``block`` alone from its declared entry; None when it cannot be reused."""
    start, stop = block.start, block.stop
    span = stop - start
    entry, exit_ = block.entry, block.exit
    enter, leave = _decls(entry), _decls(exit_)
    boundary = {o for d in (*enter.values(), *leave.values()) for o in d.explicit}
    boundary = {o for o in boundary if not 0 <= o < span}
    m = _Machine(outer.T, outer.S, outer.A)
    m.depth = outer.depth + 1
    m.lo, m.hi = start, stop
    m.allowed = frozenset(start + o for o in boundary)
    for name in _SETS:
        _held(m, name).update(enter[name].at(start))
    current_stored = entry.current is not None and (entry.current, "device") in entry.stored
    m.current = None if entry.current is None else start + entry.current
    m.current_stored = current_stored
    m.in_forward = outer.in_forward
    m.emitted, m.grad_at = start, stop
    entry_states, entry_remote = m.states(), len(m.remote)
    try:
        m.run(block.parts(), memo)
    except (ScheduleError, _NotLocal):
        return None
    exit_stored = exit_.current is not None and (exit_.current, "device") in exit_.stored
    if exit_.current is None:  # a reversal: ends with the Backprop that reaches x_start
        ended = not m.in_forward and m.current is None and m.grad_at == start
    else:  # a forward stretch: no backpropagation, ends on x_{start + exit.current}
        ended = (
            m.in_forward == outer.in_forward
            and m.backward_steps == 0
            and m.current == start + exit_.current
            and m.current_stored == exit_stored
        )
    if not ended or m.tapes:
        return None
    for name in _SETS:
        if _held(m, name) != set(leave[name].at(start)):
            return None
    return _Summary(
        entry_current=entry.current,
        current_stored=current_stored,
        exit_current=exit_.current,
        exit_current_stored=exit_stored,
        emitted=m.emitted - start,
        entry=enter,
        exit=leave,
        created={name: leave[name].minus(enter[name]) for name in _SETS},
        inside={name: enter[name].within(span) for name in _SETS},
        boundary=tuple(sorted(boundary)),
        entry_states=entry_states,
        entry_remote=entry_remote,
        forward_steps=m.forward_steps,
        backward_steps=m.backward_steps,
        backprops=m.backprops,
        writes=m.writes,
        reads=m.reads,
        peak_states=m.peak_states,
        peak_taped=m.peak_taped,
        peak_remote=m.peak_remote,
        peak_bytes=m.peak_bytes,
    )


def _fits(m: _Machine, block: Block, s: _Summary) -> bool:
    """Whether ``m`` is in the state the summary was made from (else run the block plainly)."""
    start, stop = block.start, block.stop
    if m.in_forward:
        if m.emitted != start:
            return False
    elif m.grad_at != stop and s.exit_current is None:
        return False
    if s.entry_current is not None:
        if m.current != start + s.entry_current or m.current_stored != s.current_stored:
            return False
    elif m.current is not None and not m.current_stored:
        return False
    if m.lo is not None:
        if not m.lo <= start <= stop <= m.hi:
            return False
        for o in s.boundary:
            if not m.lo <= start + o < m.hi and start + o not in m.allowed:
                return False
    for name in _SETS:
        held = _held(m, name)
        if not held.issuperset(s.entry[name].at(start)):
            return False  # a state the block needs is missing
        created = s.created[name]
        if (created.explicit or created.ranges) and not held.isdisjoint(created.at(start)):
            return False  # a state the block would add is already there
        if _count(held, start, stop) != s.inside[name]:
            return False  # something undeclared sits in the block's range
    return True


def _count(held: set[int], start: int, stop: int) -> int:
    """How many of ``held`` lie in ``[start, stop)``."""
    if not held:
        return 0
    if len(held) * 8 <= stop - start:
        return sum(1 for i in held if start <= i < stop)
    return len(held.intersection(range(start, stop)))


def _apply(m: _Machine, block: Block, s: _Summary) -> None:
    start = block.start
    device, prefetched = m.device, m.prefetched
    working = 1 if m.current is not None and not m.current_stored else 0
    base = len(device) + len(prefetched) + working - s.entry_states
    base_remote = len(m.remote) - s.entry_remote
    m.forward_steps += s.forward_steps
    m.backward_steps += s.backward_steps
    m.backprops += s.backprops
    m.writes += s.writes
    m.reads += s.reads
    if base + s.peak_states > m.peak_states:
        m.peak_states = base + s.peak_states
    if m.taped + s.peak_taped > m.peak_taped:
        m.peak_taped = m.taped + s.peak_taped
    if base_remote + s.peak_remote > m.peak_remote:
        m.peak_remote = base_remote + s.peak_remote
    used = base * m.S + m.taped * m.A + s.peak_bytes
    if used > m.peak_bytes:
        m.peak_bytes = used
    for name in _SETS:
        held = _held(m, name)
        held.difference_update(s.entry[name].at(start))
        held.update(s.exit[name].at(start))
    if s.exit_current is not None:  # a forward stretch
        m.current, m.current_stored = start + s.exit_current, s.exit_current_stored
        if m.in_forward:
            m.emitted = start + s.emitted
        return
    m.current, m.current_stored = None, False
    m.grad_at = start
    if m.in_forward:
        m.in_forward = False
        m.emitted = m.T


def _finish(m: _Machine, end: str) -> None:
    if m.in_forward or m.grad_at != 0:
        where = m.emitted if m.in_forward else m.grad_at
        raise ScheduleError(
            f"invalid schedule: it ends ({end}) before backpropagating to x_0; "
            f"{'the forward phase reached' if m.in_forward else 'the gradient is at'} x_{where}"
        )
    for tier in TIERS:
        if m.tier(tier):
            raise ScheduleError(
                f"invalid schedule: it ends with states {sorted(m.tier(tier))[:5]} still "
                f"stored in {tier}; every Store needs a Free"
            )
    if m.prefetched:
        raise ScheduleError(
            f"invalid schedule: prefetched states {sorted(m.prefetched)} were never loaded"
        )


def simulate(
    schedule: Schedule,
    *,
    state_bytes: int = 1,
    step_bytes: int = 1,
    costs: CostModel | None = None,
) -> Cost:
    """Execute ``schedule`` symbolically, validate it and count what it costs.

    Compact schedules are simulated block shape by block shape (a million-step Revolve in
    milliseconds); the counts are exactly those of the expanded action list.

    Args:
        schedule: the schedule to check.
        state_bytes: ``S``, bytes of one state (default 1: peaks in units of states).
        step_bytes: ``A``, bytes autograd saves for one taped step.
        costs: operation times for the modeled ``time`` (default: forward 1, backward 2).

    Raises:
        ScheduleError: the schedule is broken; the message names the action and why.
    """
    costs = costs or CostModel()
    T = schedule.T
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ScheduleError(f"a schedule needs T >= 1 steps, got T={T!r}")
    m = _Machine(T, state_bytes, step_bytes)
    try:
        m.run(schedule.parts, {})
        _finish(m, "after its last action")
    except ScheduleError:  # redo it action by action, for the exact position and message
        m = _Machine(T, state_bytes, step_bytes)
        m.run_flat(schedule.parts)
        _finish(m, f"after {len(schedule)} actions")
    time = (
        m.forward_steps * costs.forward
        + m.backward_steps * costs.backward
        + m.writes * costs.write
        + m.reads * costs.read
        + m.backprops * costs.segment
    )
    return Cost(
        T=T,
        forward_steps=m.forward_steps,
        backward_steps=m.backward_steps,
        peak_device_states=m.peak_states,
        peak_taped_steps=m.peak_taped,
        remote_writes=m.writes,
        remote_reads=m.reads,
        peak_remote_states=m.peak_remote,
        peak_bytes=m.peak_bytes,
        time=time,
        state_bytes=state_bytes,
        step_bytes=step_bytes,
        backprops=m.backprops,
    )
