"""Planning: measure a wrapped model and decide how it runs (granularity, plan, chunk).

`spikeckpt.planning.probe` measures (what one step costs in bytes and seconds, per
block too); `spikeckpt.planning.decide` decides, for [`spikeckpt.wrap`][spikeckpt.wrapping.wrap]'s models
([`Planner`][spikeckpt.planning.decide.Planner]) and for a memory budget ([`BudgetPlanner`][spikeckpt.planning.decide.BudgetPlanner], used by
[`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget]).
"""

from spikeckpt.planning.decide import (
    LAYERWISE_TIME_TOLERANCE,
    BudgetPlanner,
    Decision,
    PlanChoice,
    Planned,
    Planner,
)
from spikeckpt.planning.probe import (
    SEGMENT_PROBE_STEPS,
    Probe,
    Probed,
    block_sizes,
    probe_model,
    segment_seconds,
    step_costs,
)

__all__ = [
    "LAYERWISE_TIME_TOLERANCE",
    "SEGMENT_PROBE_STEPS",
    "BudgetPlanner",
    "Decision",
    "PlanChoice",
    "Planned",
    "Planner",
    "Probe",
    "Probed",
    "block_sizes",
    "probe_model",
    "segment_seconds",
    "step_costs",
]
