"""The schedule a ``scan`` runs: the plan resolved for ``T`` (chosen or checked against a budget
from the measuring room's numbers when it must be), cached.

Training calls ``scan`` with the same plan and ``T`` at every iteration: building a long
schedule (Revolve on 4,000 steps: about 24,000 actions, 0.09 s) and simulating it (0.06 s)
each time is wasted work. Schedules are immutable and a Plan is a value (equality and hash
over its attributes), so both are kept in small LRU caches: schedules by ``(plan, T)``,
simulator results by schedule identity, and plans planned from measurements (``"auto"``,
intervals left open, a budget to check) by the step, shapes, ``T``, tier and budget.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from spikeckpt.errors import ConfigError, ConfigTypeError
from spikeckpt.plans.schedule import Schedule
from spikeckpt.plans.simulate import Cost, simulate

__all__ = ["check_plan", "needs_measuring", "plan_key", "planned", "schedule_of", "simulate_cached"]

_CACHE_SIZE = 16
_CACHE_LOCK = threading.Lock()
_SCHEDULES: OrderedDict[Any, Schedule] = OrderedDict()
_COSTS: OrderedDict[int, tuple[Schedule, Cost]] = OrderedDict()
# plans planned from measurements, by the key ``planned`` is given
_PLANNED: OrderedDict[Any, Any] = OrderedDict()


def check_plan(plan: Any, T: int, budget: int | str | None) -> None:
    """Refuse a ``plan`` argument ``scan`` cannot run for ``T`` steps."""
    if isinstance(plan, Schedule):
        if plan.T != T:
            raise ConfigError(f"the schedule is for T={plan.T} steps but the inputs have T={T}")
        return
    if isinstance(plan, str):
        if plan != "auto":
            raise ConfigError(f"plan must be a plan object, a Schedule or 'auto', got {plan!r}")
        if budget is None:
            raise ConfigError("plan='auto' needs a device memory budget: scan(..., budget='2GiB')")
        return
    if not hasattr(plan, "schedule"):
        raise ConfigTypeError(f"plan must have a .schedule(T) method, got {type(plan).__name__}")


def needs_measuring(plan: Any, budget: int | str | None) -> bool:
    """Whether running ``plan`` needs the step measured: ``"auto"``, a plan that leaves its
    intervals open (`needs_intervals`), or a budget to check
    a plan against."""
    from spikeckpt.plans.intervals import needs_intervals

    return isinstance(plan, str) or needs_intervals(plan) or budget is not None


def planned(key: Any, plan_it: Callable[[], Any]) -> Any:
    """``plan_it()``, once per ``key`` (the last 16 kept)."""
    with _CACHE_LOCK:
        found = _PLANNED.get(key)
    if found is None:
        found = plan_it()
        _remember(_PLANNED, key, found)
    return found


def schedule_of(plan: Any, T: int) -> Schedule:
    """``plan.schedule(T)`` (a ``Schedule`` is itself), once per ``(plan, T)`` for plans
    hashed by value."""
    if isinstance(plan, Schedule):
        return plan
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


def owner_signature(owner: Any) -> Any:
    """A step's owner as the caches key it: its type and, where it has one, its
    ``probe_signature()`` (what its step holds depends on beyond code and shapes: a wrapped
    model's layers, options and outputs)."""
    if owner is None:
        return None
    signature = getattr(owner, "probe_signature", None)
    return (type(owner), signature() if callable(signature) else None)


def plan_key(
    step: Any, leaves: Sequence[Tensor], inputs: Sequence[Tensor], params: Sequence[Tensor]
) -> Any:
    """What a plan planned from measurements depends on: the step's code and the shapes,
    dtypes and devices of the state, the per-step inputs and the parameters (so a training
    loop that builds a new closure or bound method per call still hits the cache)."""
    step = getattr(step, "__wrapped__", step)  # scan(..., steps=n) wraps the user's step
    owner = getattr(step, "__self__", None)
    func = getattr(step, "__func__", step)
    code = getattr(func, "__code__", None) or type(step)
    where = owner_signature(owner)
    shapes = tuple((tuple(t.shape), t.dtype, t.device.type) for t in (*leaves, *params)) + tuple(
        (tuple(leaf.shape[1:]), leaf.dtype, leaf.device.type) for leaf in inputs
    )
    return (code, where, shapes)


def _cache_key(plan: Any, T: int) -> tuple[Any, int] | None:
    """``(plan, T)`` for plans hashed by value (`Plan`), else None."""
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
