"""Checkpointing plans as data: schedules, a validating cost simulator, and a planner.

This package is pure Python and never imports torch. A plan turns a sequence length ``T``
into a [`Schedule`][spikeckpt.plans.schedule.Schedule] (a compact, lazily expanded sequence of actions); [`simulate`][spikeckpt.plans.simulate.simulate]
validates and counts it; [`choose`][spikeckpt.plans.choose.choose] picks the fastest plan whose checkpoints and tapes fit
a number of bytes; `spikeckpt.plans.account` counts a whole training step
([`StepBytes`][spikeckpt.plans.account.StepBytes]) and [`choose_step`][spikeckpt.plans.account.choose_step] picks the fastest plan whose step fits a
budget: the choice ``scan``, ``wrap``, ``MemoryBudget``, the command line and the benchmarks make.

>>> from spikeckpt import plans
>>> plans.simulate(plans.Revolve(50).schedule(1000)).forward_steps
2948
"""

from spikeckpt.errors import BudgetTooSmall, ScheduleError
from spikeckpt.plans.account import (
    StepBytes,
    StepChoice,
    StepSizes,
    check_step,
    choose_step,
    rank_steps,
)
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
    "StepBytes",
    "StepChoice",
    "StepSizes",
    "Store",
    "Tape",
    "Tier",
    "TwoLevel",
    "Uniform",
    "advances",
    "beta",
    "check_step",
    "choose",
    "choose_step",
    "make_schedule",
    "minimum_budget",
    "rank",
    "rank_steps",
    "reps",
    "simulate",
]
