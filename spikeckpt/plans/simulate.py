"""Symbolic execution of a schedule: validates it and counts steps, transfers and peak memory.

Memory convention (documented in docs/concepts): device memory at any moment is
``states * S + taped * A`` where ``states`` counts the device checkpoints, the prefetch buffers
holding remote states, and the current (working) state when it is not itself a stored
checkpoint; ``taped`` counts the steps whose autograd tape is alive. The peak is taken over all
moments of the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spikeckpt.errors import ScheduleError
from spikeckpt.plans.schedule import (
    TIERS,
    Action,
    Advance,
    Backprop,
    Free,
    Load,
    Prefetch,
    Schedule,
    Store,
    Tape,
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
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"CostModel.{name} must be a non-negative number, got {value!r}")


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


@dataclass
class _Machine:
    T: int
    current: int | None = 0
    current_stored: bool = False
    stored: dict[str, set[int]] = field(default_factory=lambda: {tier: set() for tier in TIERS})
    prefetched: set[int] = field(default_factory=set)
    tapes: list[tuple[int, int]] = field(default_factory=list)
    taped: int = 0
    grad_at: int = 0
    emitted: int = 0
    in_forward: bool = True
    forward_steps: int = 0
    backward_steps: int = 0
    backprops: int = 0
    writes: int = 0
    reads: int = 0
    peak_states: int = 0
    peak_taped: int = 0
    peak_remote: int = 0
    peak_bytes: int = 0

    def device_states(self) -> int:
        working = 1 if self.current is not None and not self.current_stored else 0
        return len(self.stored["device"]) + len(self.prefetched) + working


def _fail(position: int, action: Action, reason: str) -> ScheduleError:
    return ScheduleError(f"invalid schedule at action {position} ({action!r}): {reason}")


def _run_steps(m: _Machine, position: int, action: Advance | Tape) -> None:
    a, b = action.start, action.stop
    if not 0 <= a < b <= m.T:
        raise _fail(position, action, f"needs 0 <= start < stop <= T={m.T}")
    if m.current != a:
        where = "no current state (Load one first)" if m.current is None else f"x_{m.current}"
        raise _fail(position, action, f"starts from x_{a} but the current state is {where}")
    if m.in_forward:
        if a != m.emitted:
            raise _fail(
                position,
                action,
                f"the forward phase must run every step once in order; next step is {m.emitted}",
            )
        m.emitted = b
    m.forward_steps += b - a
    m.current, m.current_stored = b, False
    if isinstance(action, Tape):
        m.tapes.append((a, b))
        m.taped += b - a


def _store(m: _Machine, position: int, action: Store) -> None:
    if action.tier not in TIERS:
        raise _fail(position, action, f"unknown tier {action.tier!r}; use one of {TIERS}")
    if m.current != action.index:
        raise _fail(position, action, f"the current state is x_{m.current}, not x_{action.index}")
    if action.index in m.stored[action.tier]:
        raise _fail(position, action, f"x_{action.index} is already stored in {action.tier}")
    m.stored[action.tier].add(action.index)
    if action.tier == "device":
        m.current_stored = True
    else:
        m.writes += 1


def _load(m: _Machine, position: int, action: Load) -> None:
    if m.in_forward:
        raise _fail(position, action, "a Load before the first Backprop breaks the forward sweep")
    if action.tier not in TIERS:
        raise _fail(position, action, f"unknown tier {action.tier!r}; use one of {TIERS}")
    if action.index not in m.stored[action.tier]:
        raise _fail(position, action, f"x_{action.index} was never stored in {action.tier}")
    m.current = action.index
    if action.tier == "device":
        m.current_stored = True
    else:
        m.current_stored = False
        if action.index in m.prefetched:
            m.prefetched.discard(action.index)
        else:
            m.reads += 1


def _free(m: _Machine, position: int, action: Free) -> None:
    if action.tier not in TIERS or action.index not in m.stored[action.tier]:
        raise _fail(position, action, f"x_{action.index} is not stored in {action.tier}")
    m.stored[action.tier].discard(action.index)
    if action.tier == "device" and m.current == action.index:
        m.current_stored = False


def _prefetch(m: _Machine, position: int, action: Prefetch) -> None:
    if action.index not in m.stored["remote"]:
        raise _fail(position, action, f"x_{action.index} is not stored in remote")
    if action.index in m.prefetched:
        raise _fail(position, action, f"x_{action.index} is already prefetched")
    m.prefetched.add(action.index)
    m.reads += 1


def _backprop(m: _Machine, position: int, action: Backprop) -> None:
    a, b = action.start, action.stop
    if m.in_forward:
        if m.emitted != m.T:
            raise _fail(
                position,
                action,
                f"the forward phase stopped at step {m.emitted}; it must run all T={m.T} steps",
            )
        m.in_forward = False
        m.grad_at = m.T
    if not m.tapes or m.tapes[-1] != (a, b):
        raise _fail(position, action, f"steps {a}..{b - 1} are not the most recent tape")
    if b != m.grad_at:
        raise _fail(position, action, f"the state gradient is at x_{m.grad_at}, not x_{b}")
    m.tapes.pop()
    m.taped -= b - a
    m.backward_steps += b - a
    m.backprops += 1
    m.grad_at = a
    m.current, m.current_stored = None, False


_HANDLERS = {
    Advance: _run_steps,
    Tape: _run_steps,
    Store: _store,
    Load: _load,
    Free: _free,
    Prefetch: _prefetch,
    Backprop: _backprop,
}


def simulate(
    schedule: Schedule,
    *,
    state_bytes: int = 1,
    step_bytes: int = 1,
    costs: CostModel | None = None,
) -> Cost:
    """Execute ``schedule`` symbolically, validate it and count what it costs.

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
    if not isinstance(T, int) or T < 1:
        raise ScheduleError(f"a schedule needs T >= 1 steps, got T={T!r}")
    m = _Machine(T=T)
    for position, action in enumerate(schedule.actions):
        handler = _HANDLERS.get(type(action))
        if handler is None:
            raise _fail(position, action, "unknown action type")
        handler(m, position, action)  # type: ignore[operator]
        states = m.device_states()
        m.peak_states = max(m.peak_states, states)
        m.peak_taped = max(m.peak_taped, m.taped)
        m.peak_remote = max(m.peak_remote, len(m.stored["remote"]))
        m.peak_bytes = max(m.peak_bytes, states * state_bytes + m.taped * step_bytes)
    end = len(schedule.actions)
    if m.in_forward or m.grad_at != 0:
        where = m.emitted if m.in_forward else m.grad_at
        raise ScheduleError(
            f"invalid schedule: it ends (after {end} actions) before backpropagating to x_0; "
            f"{'the forward phase reached' if m.in_forward else 'the gradient is at'} x_{where}"
        )
    for tier in TIERS:
        if m.stored[tier]:
            raise ScheduleError(
                f"invalid schedule: it ends with states {sorted(m.stored[tier])[:5]} still "
                f"stored in {tier}; every Store needs a Free"
            )
    if m.prefetched:
        raise ScheduleError(
            f"invalid schedule: prefetched states {sorted(m.prefetched)} were never loaded"
        )
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
