"""Decide how a wrapped model runs: granularity (stack or layer-wise), plan and chunk.

This is the one place those decisions are made; the wrapper, `MemoryBudget` and the
command line all ask a planner here. A planner is called at every forward of a
[`CheckpointedSequence`][spikeckpt.wrapping.CheckpointedSequence] with ``decide(model, x, state)`` (``x`` time first)
and returns a `Decision`; decisions are cached per input shape ``(T, B)``.

- `Planner` (what [`wrap`][spikeckpt.wrapping.wrap] installs) follows the model's own ``plan``,
  ``budget``, ``granularity`` and ``chunk``. With a budget it asks a `BudgetPlanner`,
  which counts the whole training step ([`spikeckpt.plans.account`][spikeckpt.plans.account]): ``plan="auto"`` is
  chosen within the budget, a plan given is checked against it (and refused when its step
  does not fit). Without one, a given plan runs as given, except that a plan built without
  intervals (``Double()``, ``Uniform()``, ``TwoLevel(s)``) gets them from one probe
  (`probe_model`) through
  `fill`; ``plan="auto"`` plans to 90% of the CUDA memory free at its first call on a
  GPU (read once) and runs ``Uniform(ceil(sqrt(T)))`` on the CPU.
- `BudgetPlanner` (also what the Lightning callback installs) plans to a budget with
  the full probe, agrees across DDP ranks, and remembers its choices in a checkpoint.

Both decide the granularity the same way: with ``granularity="auto"`` layer-wise runs when
the model splits into feed-forward blocks, the readout is not callable, its modeled whole
step fits (the budget, else the stack plan's own modeled step) and
its time, calibrated by measured chunks, is at most `LAYERWISE_TIME_TOLERANCE` above the
stack plan's (calibrated by the measured step): `BudgetPlanner` weighs them, given no budget
the stack plan's step as one (`BudgetPlanner.layer_within`; with ``plan="auto"``, where no
chunk fits it, the least layer-wise step if at most `LAYERWISE_MEMORY_SLACK` times it).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from spikeckpt import plans
from spikeckpt.planning.budgeted import BudgetPlanner
from spikeckpt.planning.choice import (
    REUSE_SPAN,
    Decision,
    PlanChoice,
    Planned,
    ShapeKey,
    model_signature,
)
from spikeckpt.planning.granularity import (
    LAYERWISE_MEMORY_SLACK,
    LAYERWISE_TIME_TOLERANCE,
    chunk_for,
    layerwise_may_pay,
)
from spikeckpt.planning.probe import (
    compute_device,
    probe_model,
)
from spikeckpt.plans import Plan
from spikeckpt.plans.account import StepBytes, host_is_device
from spikeckpt.plans.intervals import fill, needs_intervals
from spikeckpt.units import parse_bytes

#: a budget that bounds nothing (the probes of `Planner._auto` run unconstrained)
_UNBOUNDED = 1 << 62

__all__ = [
    "LAYERWISE_TIME_TOLERANCE",
    "BudgetPlanner",
    "Decision",
    "PlanChoice",
    "Planned",
    "Planner",
    "StepBytes",
    "host_is_device",
    "timed_decision",
]


# ----------------------------------------------------------------------------- planners


class Planner:
    """A model's own plan, budget, granularity and chunk, decided per input shape.

    Args:
        plan: a plan, a ``Schedule`` or ``"auto"``. A plan built without intervals gets them
            from a probe of the model (once per input shape; see the module docstring).
        budget: the training step's device budget (bytes or a string like ``"2GiB"``; the
            one account of [`spikeckpt.plans.account`][spikeckpt.plans.account]): ``plan="auto"`` chooses within
            it, a plan given is checked against it (`BudgetPlanner` does both). None:
            for ``"auto"``, 90% of the CUDA memory free at the first call on a GPU (kept),
            ``Uniform(ceil(sqrt(T)))`` on the CPU; a plan given runs as given.
        granularity: ``"stack"``, ``"layer"`` or ``"auto"``.
        chunk: layer-wise steps per chunk (None: with a budget, the largest that fits it;
            without, the plan's interval, else ``ceil(sqrt(T))``).

    Attributes:
        decisions: shape ``(T, B)`` -> the `Decision` for ``granularity="auto"``.
        filled: ``(plan, T, B)`` -> the plan with the intervals it was given.
        budgeted: the `BudgetPlanner` of a budget (None without one).
    """

    def __init__(
        self, plan: Any, budget: int | str | None, granularity: str, chunk: int | None
    ) -> None:
        self.plan = plan
        self.budget = parse_bytes(budget) if budget is not None else None
        self.granularity = granularity
        self.chunk = chunk
        self.decisions: dict[ShapeKey, Decision] = {}
        #: the shapes of ``decisions`` that were measured (the others reuse a longer one's)
        self.measured: set[ShapeKey] = set()
        self.filled: dict[tuple[Any, int, int], Plan] = {}
        self.budgeted: BudgetPlanner | None = None
        #: CUDA device index -> the budget of ``plan="auto"`` without one (`_budget_for`)
        self.free_budgets: dict[int, int] = {}
        #: `model_signature` of the model ``filled`` and ``decisions`` were measured on
        self.signature: tuple[Any, ...] | None = None

    def _budget_for(self, model: Planned, x: Any) -> int | None:
        """The budget to plan with: the one given; for ``"auto"`` without one, 90% of the
        CUDA memory free at the first call on that GPU, read once and kept (None on the CPU).

        Read at every call, the budget moved whenever the caching allocator's pool or
        another process's memory did (the pool grows over the first calls and holds what
        this model's steps freed): each new value made a new `BudgetPlanner`, which probed
        the model again (forward and backward passes at several chunk lengths) inside the
        caller's step, and could shrink the budget the model's own cache had taken."""
        if self.budget is not None or not (isinstance(self.plan, str) and self.plan == "auto"):
            return self.budget
        device = compute_device(model, x)
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.free_budgets:
            free, _ = torch.cuda.mem_get_info(index)
            self.free_budgets[index] = int(free * 0.9)
        return self.free_budgets[index]

    def _filled(self, model: Planned, x: Tensor, state: Any, plan: Plan) -> Plan:
        """``plan`` with the intervals it leaves open chosen from a probe of the model."""
        T, B = int(x.shape[0]), int(x.shape[1])
        key = (plan, T, B)
        if key not in self.filled:
            probe = probe_model(model, x, state, model.storage)
            self.filled[key] = fill(
                plan,
                T,
                state_bytes=probe.state_bytes,
                step_bytes=probe.step_bytes,
                costs=probe.costs(),
                remote=model.storage != "device",
            )
        return self.filled[key]

    def decide(self, model: Planned, x: Any, state: Any) -> Decision:
        """The `Decision` for input ``x`` ``(T, B, ...)`` (a tensor or a packed train)
        from ``state``."""
        budget = self._budget_for(model, x)
        if budget is not None:  # the budget planner re-plans on a changed model itself
            return self._within_budget(model, x, state, budget)
        signature = model_signature(model)
        if signature != self.signature:  # another dtype, frozen layers, ...: measure again
            self.filled.clear()
            self.decisions.clear()
            self.measured.clear()
            self.signature = signature
        T = int(x.shape[0])
        plan = self.plan
        if isinstance(plan, str):  # "auto" on the CPU without a budget: ceil(sqrt(T))
            plan = plans.Uniform().for_length(T)
        if isinstance(plan, Plan):
            if needs_intervals(plan) and self.granularity != "layer":
                plan = self._filled(model, x, state, plan)
            plan = plan.for_length(T)  # the intervals it runs with, for T
        if self.granularity == "stack":
            return Decision("stack", plan)
        if self.granularity == "layer":
            model.layer_blocks(True)  # raises UnsupportedLayerError saying why it cannot
            chunk = self.chunk if self.chunk is not None else chunk_for(plan, T)
            return Decision("layer", plan, min(chunk, T))
        if not torch.is_grad_enabled():  # no_grad (validation): nothing taped, no probe
            return self._untaped(model, x, plan, T)
        if not layerwise_may_pay(model, x):
            return Decision("stack", plan)
        key = (T, int(x.shape[1]))
        if key not in self.decisions:
            longer = weighed_near(self.measured, *key)
            if longer is None:
                self.decisions[key] = self._auto(model, x, state, plan)
                self.measured.add(key)
            else:  # weighed at a length and batch near this one: its granularity and chunk
                found = self.decisions[longer]
                shorter = min(found.chunk, T) if found.chunk is not None else None
                self.decisions[key] = Decision(found.granularity, plan, shorter)
        return self.decisions[key]

    def _untaped(self, model: Planned, x: Any, plan: Any, T: int) -> Decision:
        """A call without autograd: layer-wise (its fused neurons, its synapses over chunks)
        where a training call of this model has run it, else the stack's plain loop (the
        stack ran every validation call: 0.84-1.19x the loop's time where layer-wise took
        0.49-0.70x)."""
        ran_layerwise = any(d.granularity == "layer" for d in self.decisions.values())
        if ran_layerwise and isinstance(plan, Plan) and layerwise_may_pay(model, x):
            return Decision("layer", plan, min(chunk_for(plan, T), T))
        return Decision("stack", plan)

    def _within_budget(self, model: Planned, x: Any, state: Any, budget: int) -> Decision:
        """With a budget: `BudgetPlanner` chooses (``plan="auto"``) or checks the plan
        given, the whole step counted (input on the device, outputs, the parameters' ``.grad``
        and the engine's gradient buffers, activations). A refusal names the budget that
        works when passed back to ``wrap``."""
        if self.budgeted is None or self.budgeted.budget_bytes != budget:
            self.budgeted = BudgetPlanner(budget, plan=self.plan)
        if self.granularity == "layer":
            model.layer_blocks(True)  # raises UnsupportedLayerError saying why it cannot
        decision = self.budgeted.decide(model, x, state)
        if decision.granularity == "layer":
            self.decisions[(int(x.shape[0]), int(x.shape[1]))] = decision
        return decision

    def _auto(self, model: Planned, x: Any, state: Any, plan: Any) -> Decision:
        """Layer-wise or the stack ``plan`` without a budget: measured, as `BudgetPlanner`
        weighs them, within the stack plan's own whole step (`BudgetPlanner.layer_within`)."""
        if not isinstance(plan, Plan) or model.layer_blocks(False) is None:
            return Decision("stack", plan)
        judge = BudgetPlanner(_UNBOUNDED, plan=plan)
        # plan="auto": its memory is a yardstick, not a limit the user set (a plan given is)
        slack = LAYERWISE_MEMORY_SLACK if isinstance(self.plan, str) else 1.0
        chunk = judge.layer_within(model, x, state, self.chunk, slack)
        if chunk is None:
            return Decision("stack", plan)
        return Decision("layer", plan, chunk)


def weighed_near(measured: set[ShapeKey], T: int, batch: int) -> ShapeKey | None:
    """The measured ``(T', batch')`` nearest ``(T, batch)`` with ``T`` within `REUSE_SPAN` of
    ``T'`` either way and ``batch' >= batch`` (None: none). Without a budget the choice is the
    faster granularity in about the stack plan's memory, which both scale with alike: data
    padded per batch to its longest sample (tonic's ``PadTensors``), and an epoch's last,
    smaller batch, measured again at every new longest length (8 of 41 batches, 0.7 s each)."""
    near = [
        key
        for key in measured
        if key[1] >= batch and key[0] / REUSE_SPAN <= T <= key[0] * REUSE_SPAN
    ]
    return min(near, key=lambda key: (abs(key[0] - T), key[1] - batch)) if near else None


def timed_decision(
    planner: Planner | BudgetPlanner, model: Planned, x: Any, state: Any
) -> tuple[Decision, float]:
    """``planner.decide(model, x, state)`` and the seconds it took: the probes of a first
    call (or of a changed model, shape or budget) run inside it; a plan reused costs
    microseconds."""
    started = time.perf_counter()
    decision = planner.decide(model, x, state)
    return decision, time.perf_counter() - started
