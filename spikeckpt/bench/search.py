"""Budget searches: the longest sequence and the widest network each strategy trains.

A strategy *fits* a device budget at a size when one metered training step
(`spikeckpt.bench.measure.measure`) peaks at or below the budget (parameters included).
Planned ``scan`` strategies get their plan from [`spikeckpt.plans.rank`][spikeckpt.plans.choose.rank] with the budget
less the parameters and their gradients; when the measured peak still exceeds the budget (the
model ignores a few temporaries), the plan budget is lowered by the excess and the plan chosen
again (at most three times).

Both searches double the size until it no longer fits (or a cap is reached), then bisect
between the last size that fit and the first that did not, to a relative resolution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from spikeckpt import plans
from spikeckpt.bench.measure import Measurement, make_context, measure, param_bytes
from spikeckpt.bench.strategies import Strategy, Workload

__all__ = ["SearchResult", "fits", "max_length", "max_width", "search"]


@dataclass
class SearchResult:
    """The largest size that fit, and every trial.

    Attributes:
        strategy: strategy name.
        quantity: ``"T"`` (steps) or ``"hidden"`` (neurons per hidden layer).
        budget_bytes: the device budget.
        best: largest size that fit (0 if none did).
        capped: the search stopped at its cap while still fitting (the true maximum is larger).
        best_row: the measurement at ``best``.
        trials: ``(size, fits, peak_bytes, plan)`` in the order tried.
    """

    strategy: str
    quantity: str
    budget_bytes: int
    best: int = 0
    capped: bool = False
    best_row: Measurement | None = None
    trials: list[tuple[int, bool, int | None, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = asdict(self)
        data["best_row"] = self.best_row.as_dict() if self.best_row else None
        return data


def fits(
    strategy: Strategy,
    workload: Workload,
    T: int,
    budget: int,
    costs: plans.CostModel,
    directory: str | None,
    device: torch.device | None = None,
) -> Measurement:
    """One metered step of ``strategy`` at ``T`` planned for ``budget``; ``.fits`` says if it fit."""
    ctx = make_context(
        workload, T, plan_budget=None, costs=costs, directory=directory, device=device
    )
    plan_budget = budget - 2 * param_bytes(ctx.model)
    row: Measurement | None = None
    for _ in range(4):
        if plan_budget <= 0:
            break
        ctx.plan_budget = plan_budget
        row, _ = measure(strategy, ctx, time_it=False)
        if not row.fits:
            return row
        assert row.peak_bytes is not None
        excess = row.peak_bytes - budget
        if excess <= 0:
            return row
        row.fits = False
        if strategy.name in ("bptt", "checkpoint", "save_on_cpu", "uniform-sqrt"):
            return row  # nothing to re-plan
        plan_budget -= excess + ctx.state_bytes
    if row is None:
        row = Measurement(
            strategy.name, strategy.label, T, workload.hidden, workload.batch, "-", False
        )
        row.note = "the parameters alone exceed the budget"
    return row


def search(
    probe: Callable[[int], Measurement],
    *,
    start: int,
    cap: int,
    resolution: float = 1 / 16,
    result: SearchResult,
) -> SearchResult:
    """Doubling from ``start`` up to ``cap``, then bisection to ``resolution`` (relative).

    ``probe(size)`` returns a measurement whose ``fits`` says whether ``size`` fits.
    """
    memo: dict[int, Measurement] = {}

    def ok(size: int) -> bool:
        if size not in memo:
            row = memo[size] = probe(size)
            result.trials.append((size, row.fits, row.peak_bytes, row.plan))
        return memo[size].fits

    lo, hi = 0, None  # lo fits (0: nothing yet), hi does not
    size = max(1, start)
    if not ok(size):
        hi = size
        size //= 2
        while size >= 1 and not ok(size):
            hi, size = size, size // 2
        lo = size
    else:
        lo = size
        while lo < cap:
            size = min(cap, lo * 2)
            if ok(size):
                lo = size
            else:
                hi = size
                break
    if hi is None:
        result.capped = lo >= cap
    else:
        while lo > 0 and hi - lo > max(1, int(lo * resolution)):
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
    result.best = lo
    result.best_row = memo.get(lo)
    return result


def max_length(
    strategy: Strategy,
    workload: Workload,
    budget: int,
    costs: plans.CostModel,
    directory: str | None,
    *,
    start: int = 8,
    cap: int = 4096,
    resolution: float = 1 / 16,
    device: torch.device | None = None,
) -> SearchResult:
    """Largest ``T`` (steps) that ``strategy`` trains within ``budget`` bytes."""
    result = SearchResult(strategy.name, "T", budget)
    return search(
        lambda T: fits(strategy, workload, T, budget, costs, directory, device),
        start=start,
        cap=cap,
        resolution=resolution,
        result=result,
    )


def max_width(
    strategy: Strategy,
    workload: Workload,
    T: int,
    budget: int,
    costs: plans.CostModel,
    directory: str | None,
    *,
    start: int = 8,
    cap: int = 4096,
    resolution: float = 1 / 16,
    device: torch.device | None = None,
) -> SearchResult:
    """Largest hidden width (neurons per hidden layer) trainable at ``T`` within ``budget``."""
    result = SearchResult(strategy.name, "hidden", budget)
    return search(
        lambda h: fits(strategy, workload.with_hidden(h), T, budget, costs, directory, device),
        start=start,
        cap=cap,
        resolution=resolution,
        result=result,
    )
