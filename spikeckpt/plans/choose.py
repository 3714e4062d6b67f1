"""Pick the fastest plan that fits a device memory budget. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass

from spikeckpt.errors import BudgetTooSmall
from spikeckpt.plans.base import Plan, check_count, check_length
from spikeckpt.plans.bptt import BPTT
from spikeckpt.plans.double import Double
from spikeckpt.plans.revolve import Revolve
from spikeckpt.plans.simulate import Cost, CostModel
from spikeckpt.plans.twolevel import TwoLevel
from spikeckpt.plans.uniform import Uniform
from spikeckpt.units import format_bytes, parse_bytes

#: Order used to break ties in modeled time: simpler plans first.
_SIMPLICITY = (BPTT, Uniform, Revolve, Double, TwoLevel)


@dataclass(frozen=True)
class Candidate:
    """A plan that fits, with its modeled cost for the ``T`` it was chosen for."""

    plan: Plan
    cost: Cost

    def time_factor(self, costs: CostModel) -> float:
        """Modeled time relative to plain BPTT."""
        return self.cost.time_factor(costs)


def _grid(limit: int, points: int = 48) -> list[int]:
    """About ``points`` integers from 1 to ``limit``, geometrically spaced, plus the ends."""
    values = {1, limit}
    for i in range(points + 1):
        values.add(max(1, min(limit, round(limit ** (i / points)))))
    return sorted(values)


def _uniform_intervals(T: int) -> list[int]:
    """The intervals worth trying for ``T`` steps, ascending: each count of segments ``n``'s
    shortest interval ``ceil(T / n)`` (O(sqrt(T)) of them). A longer interval with the same
    ``n`` holds more taped steps and recomputes more (``T + (n - 1) k`` evaluations), so it
    never fits where the shortest does not nor runs faster; the fastest fitting interval,
    the shortest of ties, is the one a sweep over every interval finds."""
    root = math.isqrt(T) + 1
    return sorted(set(range(1, min(T, root) + 1)) | {-(-T // n) for n in range(1, root + 1)})


def _uniform(T: int, S: int, A: int, budget: int, costs: CostModel) -> list[Candidate]:
    best: Candidate | None = None
    for interval in _uniform_intervals(T):
        cost = Uniform(interval).cost(T, state_bytes=S, step_bytes=A, costs=costs)
        if cost.peak_bytes <= budget and (best is None or cost.time < best.cost.time):
            best = Candidate(Uniform(interval), cost)
    return [best] if best else []


def _revolve(T: int, S: int, A: int, budget: int, costs: CostModel) -> list[Candidate]:
    """The fastest Revolve that fits: for each tape length on a grid, the most slots."""
    best: Candidate | None = None
    for tape in _grid(T) if costs.segment > 0 else [1]:
        n = -(-T // tape)
        slots = min(n, (budget - tape * A) // S - 1)
        if slots < 1:
            break  # longer tapes only take more memory
        plan = Revolve(slots, tape)
        cost = plan.cost(T, state_bytes=S, step_bytes=A, costs=costs)
        if cost.peak_bytes <= budget and (best is None or cost.time < best.cost.time):
            best = Candidate(plan, cost)
    return [best] if best else []


def _double(T: int, S: int, A: int, budget: int, costs: CostModel) -> list[Candidate]:
    best: Candidate | None = None
    for remote in _grid(T):
        optimum = max(1, round(math.sqrt(remote * S / A)))
        locals_ = {min(remote, max(1, optimum + d)) for d in (-1, 0, 1)} | set(_grid(remote, 24))
        for local in sorted(locals_):
            plan = Double(remote, local)
            cost = plan.cost(T, state_bytes=S, step_bytes=A, costs=costs)
            if cost.peak_bytes <= budget and (best is None or cost.time < best.cost.time):
                best = Candidate(plan, cost)
    return [best] if best else []


def _two_level(T: int, S: int, A: int, budget: int, costs: CostModel) -> list[Candidate]:
    slots = min(T, (budget - A) // S - 1)  # TwoLevel holds at most slots + 1 states
    if slots < 1:
        return []
    plan = TwoLevel(slots, costs.write, costs.read, costs.forward, costs.backward)
    cost = plan.cost(T, state_bytes=S, step_bytes=A, costs=costs)
    return [Candidate(plan, cost)] if cost.peak_bytes <= budget else []


def minimum_budget(T: int, state_bytes: int, step_bytes: int) -> int:
    """The smallest device budget (bytes) any plan fits: ``min(S + T*A, 2S + A)``."""
    return min(state_bytes + T * step_bytes, 2 * state_bytes + step_bytes)


def rank(
    T: int,
    state_bytes: int,
    step_bytes: int,
    budget_bytes: int | str,
    *,
    remote: bool = True,
    costs: CostModel | None = None,
) -> list[Candidate]:
    """Every plan family's best member that fits ``budget_bytes``, fastest first.

    Args:
        T: steps.
        state_bytes: ``S``, bytes of one state.
        step_bytes: ``A``, bytes autograd saves for one taped step.
        budget_bytes: device budget, bytes or a string such as ``"512MiB"``.
        remote: whether a remote (host/disk) tier may be used (Double, TwoLevel).
        costs: operation times for the modeled time (default [`CostModel`][spikeckpt.plans.simulate.CostModel]).

    Returns:
        Candidates sorted by modeled time, ties broken towards simpler plans; empty when
        nothing fits.
    """
    T = check_length(T)
    S = check_count("state_bytes", state_bytes)
    A = check_count("step_bytes", step_bytes)
    assert S is not None and A is not None
    budget = parse_bytes(budget_bytes)
    costs = costs or CostModel()
    candidates: list[Candidate] = []
    bptt = Candidate(BPTT(), BPTT().cost(T, state_bytes=S, step_bytes=A, costs=costs))
    if bptt.cost.peak_bytes <= budget:
        candidates.append(bptt)
    candidates += _uniform(T, S, A, budget, costs) + _revolve(T, S, A, budget, costs)
    if remote:
        candidates += _double(T, S, A, budget, costs) + _two_level(T, S, A, budget, costs)
    candidates.sort(key=lambda c: (c.cost.time, _SIMPLICITY.index(type(c.plan))))
    return candidates


def choose(
    T: int,
    state_bytes: int,
    step_bytes: int,
    budget_bytes: int | str,
    *,
    remote: bool = True,
    costs: CostModel | None = None,
) -> Plan:
    """The plan with the least modeled time whose modeled device peak fits the budget.

    Considers BPTT, Uniform (best interval), Revolve (most slots that fit; with a
    ``costs.segment`` overhead also the best tape length) and, when
    ``remote`` is allowed, Double (best intervals) and TwoLevel. See [`rank`][spikeckpt.plans.choose.rank].

    Raises:
        BudgetTooSmall: nothing fits; the message states the smallest budget that would.
        ValueError: bad T, sizes or budget string.
    """
    candidates = rank(T, state_bytes, step_bytes, budget_bytes, remote=remote, costs=costs)
    if candidates:
        return candidates[0].plan
    budget = parse_bytes(budget_bytes)
    smallest = minimum_budget(T, state_bytes, step_bytes)
    raise BudgetTooSmall(
        f"no checkpointing plan fits a device budget of {budget} bytes "
        f"({format_bytes(budget)}) for T={T} steps with a state of {state_bytes} bytes and "
        f"{step_bytes} bytes taped per step; the smallest budget that fits is {smallest} bytes "
        f"({format_bytes(smallest)}). Raise the budget, shorten the sequence or shrink the batch.",
        budget_bytes=budget,
        minimum_bytes=smallest,
    )
