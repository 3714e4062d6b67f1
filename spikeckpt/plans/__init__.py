"""Checkpointing plans as data: schedules, a validating cost simulator, and a planner.

This package is pure Python and never imports torch. A plan turns a sequence length ``T``
into a [`Schedule`][spikeckpt.plans.schedule.Schedule] (a compact, lazily expanded sequence of actions); [`simulate`][spikeckpt.plans.simulate.simulate]
validates and counts it; [`choose`][spikeckpt.plans.choose.choose] picks the fastest plan that fits a device memory
budget.

>>> from spikeckpt import plans
>>> plans.simulate(plans.Revolve(50).schedule(1000)).forward_steps
2948
"""

from spikeckpt.errors import BudgetTooSmall, ScheduleError
from spikeckpt.plans.base import Plan
from spikeckpt.plans.binomial import advances, beta, reps
from spikeckpt.plans.bptt import BPTT
from spikeckpt.plans.choose import Candidate, choose, minimum_budget, rank
from spikeckpt.plans.double import Double
from spikeckpt.plans.layerwise import (
    BlockSizes,
    LayerwiseCost,
    MeasuredWorking,
    fitting_chunk,
    layerwise_cost,
    packed_bytes,
)
from spikeckpt.plans.revolve import Revolve
from spikeckpt.plans.schedule import (
    Action,
    Advance,
    Backprop,
    Free,
    Load,
    Prefetch,
    Schedule,
    Store,
    Tape,
    Tier,
    make_schedule,
)
from spikeckpt.plans.simulate import Cost, CostModel, simulate
from spikeckpt.plans.twolevel import TwoLevel
from spikeckpt.plans.uniform import Uniform

__all__ = [
    "BPTT",
    "Action",
    "Advance",
    "Backprop",
    "BlockSizes",
    "LayerwiseCost",
    "MeasuredWorking",
    "fitting_chunk",
    "layerwise_cost",
    "packed_bytes",
    "BudgetTooSmall",
    "Candidate",
    "Cost",
    "CostModel",
    "Double",
    "Free",
    "Load",
    "Plan",
    "Prefetch",
    "Revolve",
    "Schedule",
    "ScheduleError",
    "Store",
    "Tape",
    "Tier",
    "TwoLevel",
    "Uniform",
    "advances",
    "beta",
    "choose",
    "make_schedule",
    "minimum_budget",
    "rank",
    "reps",
    "simulate",
]
