"""The schedule a ``scan`` runs: a plan resolved for ``T``, filled from measurements, cached.

Training calls ``scan`` with the same plan and ``T`` at every iteration: building a long
schedule (Revolve on 4,000 steps: about 24,000 actions, 0.09 s) and simulating it (0.06 s)
each time is wasted work. Schedules are immutable and a Plan is a value (equality and hash
over its attributes), so both are kept in small LRU caches: schedules by ``(plan, T)``,
simulator results by schedule identity, and plans chosen from measurements (``"auto"``,
intervals left open) by the step, shapes, ``T`` and tier.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from spikeckpt.errors import ConfigError, ConfigTypeError
from spikeckpt.plans.schedule import Schedule
from spikeckpt.plans.simulate import Cost, CostModel, simulate

__all__ = ["plan_key", "resolve_schedule", "simulate_cached"]

_CACHE_SIZE = 16
_CACHE_LOCK = threading.Lock()
_SCHEDULES: OrderedDict[Any, Schedule] = OrderedDict()
_COSTS: OrderedDict[int, tuple[Schedule, Cost]] = OrderedDict()
# plans chosen from measurements ("auto", intervals left open), by resolve_schedule's key
_PLANNED: OrderedDict[Any, Any] = OrderedDict()


def resolve_schedule(
    plan: Any,
    T: int,
    measure: Callable[[], tuple[int, int]],
    budget: int | str | None,
    storage: str,
    timings: Callable[[], CostModel] | None = None,
    measured: Any = None,
    reserve: Callable[[int], int] = lambda S: 0,
    *,
    apart: int = 0,
) -> Schedule:
    """The schedule to run. ``"auto"`` and plans that leave their intervals open
    (:func:`spikeckpt.plans.intervals.needs_intervals`) are planned from ``measure()``
    (``S``, ``A``) and ``timings()`` (the measured operation times), once per ``measured``
    key (the step, shapes and tier: see :func:`plan_key`; None: every time); ``"auto"``
    keeps ``reserve(S)`` bytes of the budget for the gradients. ``apart``: steps the caller
    ran before these ``T`` (step 0 of a state it shapes), counted in messages."""
    if isinstance(plan, Schedule):
        if plan.T != T:
            raise ConfigError(f"the schedule is for T={plan.T} steps but the inputs have T={T}")
        return plan
    if isinstance(plan, str):
        if plan != "auto":
            raise ConfigError(f"plan must be a plan object, a Schedule or 'auto', got {plan!r}")
        if budget is None:
            raise ConfigError("plan='auto' needs a device memory budget: scan(..., budget='2GiB')")
    from spikeckpt.plans.intervals import needs_intervals

    if isinstance(plan, str) or needs_intervals(plan):
        plan = _measured_plan(plan, T, measure, budget, storage, timings, measured, reserve, apart)
    if not hasattr(plan, "schedule"):
        raise ConfigTypeError(f"plan must have a .schedule(T) method, got {type(plan).__name__}")
    return _schedule_of(plan, T)


def _measured_plan(
    plan: Any,
    T: int,
    measure: Callable[[], tuple[int, int]],
    budget: int | str | None,
    storage: str,
    timings: Callable[[], CostModel] | None,
    measured: Any,
    reserve: Callable[[int], int],
    apart: int,
) -> Any:
    """``"auto"`` chosen, or ``plan``'s open intervals filled, from the measurements (cached
    by ``measured``)."""
    from spikeckpt.plans.intervals import fill

    key = None if measured is None else (plan, budget, T, storage, measured)
    with _CACHE_LOCK:
        planned = _PLANNED.get(key) if key is not None else None
    if planned is not None:
        return planned
    S, A = measure()
    costs = timings() if timings is not None else None
    if isinstance(plan, str):
        planned = _choose(T, S, max(A, 1), budget, storage, costs, reserve(S), apart)
    else:
        planned = fill(
            plan, T, state_bytes=S, step_bytes=A, costs=costs, remote=storage != "device"
        )
    if key is not None:
        _remember(_PLANNED, key, planned)
    return planned


def _schedule_of(plan: Any, T: int) -> Schedule:
    """``plan.schedule(T)``, once per ``(plan, T)`` for plans hashed by value."""
    key = _cache_key(plan, T)
    if key is not None:
        with _CACHE_LOCK:
            cached = _SCHEDULES.get(key)
            if cached is not None:
                _SCHEDULES.move_to_end(key)
                return cached
    if hasattr(plan, "for_length"):
        plan = plan.for_length(T)
    schedule = plan.schedule(T)
    if key is not None and isinstance(schedule, Schedule):
        _remember(_SCHEDULES, key, schedule)
    return schedule


def _choose(
    T: int,
    S: int,
    A: int,
    budget: int | str | None,
    storage: str,
    costs: CostModel | None,
    reserve: int,
    apart: int = 0,
) -> Any:
    """``plans.choose`` for ``budget`` less ``reserve`` (the gradients' bytes: the budget
    bounds the whole backward pass, not only checkpoints and tapes)."""
    from spikeckpt.errors import BudgetTooSmall
    from spikeckpt.plans import choose, minimum_budget
    from spikeckpt.units import format_bytes, parse_bytes

    total = parse_bytes(budget)  # type: ignore[arg-type]
    try:
        return choose(T, S, A, max(total - reserve, 1), remote=storage != "device", costs=costs)
    except BudgetTooSmall:
        smallest = minimum_budget(T, S, A) + reserve
        steps = f"T={T + apart} steps" + (
            f" (step 0 runs apart, taped; the checkpointed run has {T})" if apart else ""
        )
        raise BudgetTooSmall(
            f"no checkpointing plan fits a device budget of {total} bytes ({format_bytes(total)})"
            f" for {steps} with a state of {S} bytes, {A} bytes taped per step and "
            f"{reserve} bytes for the gradients; the smallest budget that fits is {smallest} "
            f"bytes ({format_bytes(smallest)}). Raise the budget, shorten the sequence or "
            "shrink the batch.",
            budget_bytes=total,
            minimum_bytes=smallest,
        ) from None


def plan_key(
    step: Any, leaves: Sequence[Tensor], inputs: Sequence[Tensor], params: Sequence[Tensor]
) -> Any:
    """What a plan filled from measurements depends on: the step's code and the shapes,
    dtypes and devices of the state, the per-step inputs and the parameters (so a training
    loop that builds a new closure or bound method per call still hits the cache)."""
    owner = getattr(step, "__self__", None)
    func = getattr(step, "__func__", step)
    code = getattr(func, "__code__", None) or type(step)
    where = type(owner) if owner is not None else None
    shapes = tuple((tuple(t.shape), t.dtype, t.device.type) for t in (*leaves, *params)) + tuple(
        (tuple(leaf.shape[1:]), leaf.dtype, leaf.device.type) for leaf in inputs
    )
    return (code, where, shapes)


def _cache_key(plan: Any, T: int) -> tuple[Any, int] | None:
    """``(plan, T)`` for plans hashed by value (:class:`spikeckpt.plans.base.Plan`), else None."""
    from spikeckpt.plans.base import Plan

    if not isinstance(plan, Plan) or type(plan).__hash__ is not Plan.__hash__:
        return None  # identity-hashed or custom plans may change under the same key
    try:
        hash(plan)
    except TypeError:  # an unhashable attribute
        return None
    return plan, T


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    with _CACHE_LOCK:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)


def simulate_cached(schedule: Schedule) -> Cost:
    """``simulate(schedule)`` (validates it; raises ``ScheduleError``), once per schedule."""
    with _CACHE_LOCK:
        cached = _COSTS.get(id(schedule))
    if cached is not None and cached[0] is schedule:
        return cached[1]
    cost = simulate(schedule)
    _remember(_COSTS, id(schedule), (schedule, cost))
    return cost
