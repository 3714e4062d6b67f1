"""Intervals for plans built without them, from measured sizes and costs. Pure Python.

``Uniform()``, ``Double()`` and ``TwoLevel(s)`` leave their intervals (or, for ``TwoLevel``,
the transfer costs its segment lengths depend on) to be filled in for a sequence. Their own
``for_length(T)`` falls back on ``ceil(sqrt(T))``-style defaults; when the engine knows the
state's bytes ``S``, the bytes one taped step keeps ``A`` and the measured operation times
([`CostModel`][spikeckpt.plans.simulate.CostModel]), `fill` picks them from those instead:

- ``Uniform()``: the checkpoint interval with the least modeled device peak (about
  ``sqrt(T*S/A)``); among the intervals within `TOLERANCE` of that peak, the fastest
  (fewer backward calls).
- ``Double()`` (either interval missing): every ``(K, k)`` pair on a grid whose modeled peak
  is at most the least peak of ``Uniform`` for the same ``T`` (above it, plain ``Uniform`` is
  the better plan). Among those whose modeled time is within `TOLERANCE` of the recompute
  floor ``T*(2*forward + backward)`` (two evaluations and one backward per step, no transfers,
  no calls), the one with the least peak; when none is (transfers too slow for this ``T``),
  the fastest. The memory-only default (``k = sqrt(K*S/A)``) evaluates about three times per
  step; this choice about twice, with ``K`` long enough to hide the remote copies.
- ``TwoLevel(s)`` with its default costs (no transfer cost, so a remote checkpoint at every
  step) and no ``remote_interval``: the measured write, read, forward and backward times.

``Revolve(s)`` and plans whose intervals are given are returned as they are.

>>> from spikeckpt import plans
>>> costs = plans.CostModel(forward=1.0, backward=1.65, write=2.0, read=2.0, segment=1.0)
>>> fill(plans.Uniform(), 1000, state_bytes=34_000, step_bytes=50_000, costs=costs)
Uniform(interval=35)
>>> double = fill(plans.Double(), 1000, state_bytes=34_000, step_bytes=50_000, costs=costs)
>>> double.cost(1000).forward_steps / 1000 < 2.1
True
"""

from __future__ import annotations

import math

from spikeckpt.plans.base import Plan, check_count, check_length, geometric_grid
from spikeckpt.plans.double import Double
from spikeckpt.plans.simulate import Cost, CostModel
from spikeckpt.plans.twolevel import TwoLevel
from spikeckpt.plans.uniform import Uniform

__all__ = ["TOLERANCE", "fill", "needs_intervals"]

#: how far above the best (least peak, or the recompute floor's time) a filled plan may be
TOLERANCE = 0.05


def needs_intervals(plan: object) -> bool:
    """Whether ``plan`` leaves intervals (or TwoLevel's costs) for `fill` to choose."""
    if type(plan) is Uniform:
        return plan.interval is None
    if type(plan) is Double:
        return plan.remote_interval is None or plan.local_interval is None
    if type(plan) is TwoLevel:
        return plan.remote_interval is None and (
            plan.write_cost,
            plan.read_cost,
            plan.forward_cost,
            plan.backward_cost,
        ) == (0.0, 0.0, 1.0, 2.0)
    return False


def _uniform(T: int, S: int, A: int, costs: CostModel | None) -> tuple[Uniform, Cost]:
    """The ``Uniform`` with the least peak; the fastest within TOLERANCE of that peak."""
    best = max(1, min(T, round(math.sqrt(T * S / A))))
    intervals = set(range(max(1, best // 3), min(T, 3 * best) + 1)) | set(geometric_grid(T))
    found = [
        (Uniform(k), Uniform(k).cost(T, state_bytes=S, step_bytes=A, costs=costs))
        for k in sorted(intervals)
    ]
    least = min(cost.peak_bytes for _, cost in found)
    near = [item for item in found if item[1].peak_bytes <= least * (1 + TOLERANCE)]
    return min(near, key=lambda item: (item[1].time, item[1].peak_bytes))


def _double(plan: Double, T: int, S: int, A: int, costs: CostModel, remote: bool) -> Double | None:
    cap = _uniform(T, S, A, costs)[1].peak_bytes
    floor = T * (2 * costs.forward + costs.backward)
    remotes = [plan.remote_interval] if plan.remote_interval is not None else geometric_grid(T)
    found: list[tuple[Double, int, float]] = []
    for K in remotes:
        K = min(K, T)
        if plan.local_interval is not None:
            locals_ = {min(plan.local_interval, K)}
        else:
            optimum = max(1, round(math.sqrt(K * S / A)))
            locals_ = {min(K, max(1, optimum + d)) for d in (-1, 0, 1)} | set(geometric_grid(K, 24))
        for k in sorted(locals_):
            candidate = Double(K, k)
            cost = candidate.cost(T, state_bytes=S, step_bytes=A, costs=costs)
            peak = cost.peak_bytes
            if not remote:  # the "remote" states stay on the device too
                peak += cost.peak_remote_states * S
            found.append((candidate, peak, cost.time))
    fits = [item for item in found if item[1] <= cap] or found
    near = [item for item in fits if item[2] <= floor * (1 + TOLERANCE)]
    if near:
        return min(near, key=lambda item: (item[1], item[2]))[0]
    return min(fits, key=lambda item: (item[2], item[1]))[0]


def fill(
    plan: Plan,
    T: int,
    *,
    state_bytes: int,
    step_bytes: int,
    costs: CostModel | None,
    remote: bool = True,
) -> Plan:
    """``plan`` with the intervals it leaves open chosen for ``T`` steps (see the module).

    Args:
        plan: any plan; only those `needs_intervals` accepts are changed.
        T: steps.
        state_bytes: ``S``, bytes of one state.
        step_bytes: ``A``, bytes autograd keeps for one taped step.
        costs: measured operation times (any one unit); ``None``: sizes only (``Uniform``;
            ``Double`` and ``TwoLevel`` then keep their own defaults).
        remote: whether remote checkpoints leave the device (False: ``storage="device"``,
            so ``Double``'s remote states count as device memory).

    Returns:
        A plan with its intervals set for ``T`` (``plan.for_length(T)`` for the others).
    """
    T = check_length(T)
    S = check_count("state_bytes", state_bytes)
    A = check_count("step_bytes", max(step_bytes, 1))
    assert S is not None and A is not None
    if not needs_intervals(plan):
        return plan.for_length(T)
    if isinstance(plan, Uniform):
        return _uniform(T, S, A, costs)[0]
    if costs is None:
        return plan.for_length(T)
    if isinstance(plan, Double):
        chosen = _double(plan, T, S, A, costs, remote)
        return chosen if chosen is not None else plan.for_length(T)
    if isinstance(plan, TwoLevel):
        return TwoLevel(plan.slots, costs.write, costs.read, costs.forward, costs.backward)
    return plan.for_length(T)  # pragma: no cover - needs_intervals covers the kinds above
