"""Decide how a wrapped model runs: granularity (stack or layer-wise), plan and chunk.

This is the one place those decisions are made; the wrapper, :class:`MemoryBudget` and the
command line all ask a planner here. A planner is called at every forward of a
:class:`~spikeckpt.CheckpointedSequence` with ``decide(model, x, state)`` (``x`` time first)
and returns a :class:`Decision`; decisions are cached per input shape ``(T, B)``.

- :class:`Planner` (what :func:`spikeckpt.wrap` installs) follows the model's own ``plan``,
  ``budget``, ``granularity`` and ``chunk``: a given plan runs as given, except that a plan
  built without intervals (``Double()``, ``Uniform()``, ``TwoLevel(s)``) gets them from one
  probe (:func:`~spikeckpt.planning.probe.probe_model`: sizes and step, call and copy times)
  through :func:`spikeckpt.plans.intervals.fill`; ``plan="auto"`` with a budget is chosen by
  :func:`spikeckpt.scan` (:func:`spikeckpt.plans.choose` on the measured sizes and times);
  without a budget, 90% of the free CUDA memory on a GPU, ``Uniform(ceil(sqrt(T)))`` on the
  CPU. With ``granularity="layer"`` and a budget, the chunk is the largest that fits it.
- :class:`BudgetPlanner` (what the Lightning callback installs) plans to a budget with the
  full probe (:func:`~spikeckpt.planning.probe.probe_model`: sizes and measured step, call and
  copy times), agrees across DDP ranks, and remembers its choices in a checkpoint.

Both decide the granularity the same way (:func:`layer_or_stack`): with ``granularity="auto"``
layer-wise runs when the model splits into feed-forward blocks, the readout is not callable,
the input is exactly binary, its modeled device peak fits (the budget, else the stack plan's
own modeled peak) and its modeled time is at most :data:`LAYERWISE_TIME_TOLERANCE` above the
stack plan's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from spikeckpt import plans
from spikeckpt.engine.layerwise import chunk_for
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.planning.budgeted import BudgetPlanner
from spikeckpt.planning.choice import Decision, PlanChoice, Planned, StepBytes
from spikeckpt.planning.granularity import (
    LAYERWISE_TIME_TOLERANCE,
    host_is_device,
    layer_or_stack,
    layerwise_candidate,
    layerwise_may_pay,
)
from spikeckpt.planning.probe import (
    compute_device,
    probe_model,
    trainable_bytes,
)
from spikeckpt.plans import Plan
from spikeckpt.plans.intervals import fill, needs_intervals
from spikeckpt.plans.layerwise import (
    fitting_chunk,
    layerwise_cost,
)
from spikeckpt.units import format_bytes, parse_bytes

__all__ = [
    "LAYERWISE_TIME_TOLERANCE",
    "BudgetPlanner",
    "Decision",
    "PlanChoice",
    "Planned",
    "Planner",
    "StepBytes",
    "host_is_device",
    "layer_or_stack",
]

ShapeKey = tuple[int, int]


# ----------------------------------------------------------------------------- planners


class Planner:
    """A model's own plan, budget, granularity and chunk, decided per input shape.

    Args:
        plan: a plan, a ``Schedule`` or ``"auto"``. A plan built without intervals gets them
            from a probe of the model (once per input shape; see the module docstring).
        budget: device bytes (or a string like ``"2GiB"``) for ``plan="auto"`` (None: 90% of
            the free CUDA memory on a GPU, ``Uniform(ceil(sqrt(T)))`` on the CPU).
        granularity: ``"stack"``, ``"layer"`` or ``"auto"``.
        chunk: layer-wise steps per chunk (None: with a budget, the largest that fits it;
            without, the plan's interval, else ``ceil(sqrt(T))``; with ``granularity="auto"``
            and a budget, the largest that fits up to that).

    Attributes:
        decisions: shape ``(T, B)`` -> the :class:`Decision` for ``granularity="auto"``.
        filled: ``(plan, T, B)`` -> the plan with the intervals it was given.
        chunks: ``(T, B)`` -> the layer-wise chunk chosen for the budget.
    """

    def __init__(
        self, plan: Any, budget: int | str | None, granularity: str, chunk: int | None
    ) -> None:
        self.plan = plan
        self.budget = parse_bytes(budget) if budget is not None else None
        self.granularity = granularity
        self.chunk = chunk
        self.decisions: dict[ShapeKey, Decision] = {}
        self.filled: dict[tuple[Any, int, int], Plan] = {}
        self.chunks: dict[ShapeKey, int] = {}
        self.budgeted: BudgetPlanner | None = None

    def _plan_for(self, model: Planned, x: Any) -> tuple[Any, int | None]:
        if not (isinstance(self.plan, str) and self.plan == "auto" and self.budget is None):
            return self.plan, self.budget
        device = compute_device(model, x)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return "auto", int(free * 0.9)
        return plans.Uniform().for_length(int(x.shape[0])), None

    def _filled(self, model: Planned, x: Tensor, state: Any, plan: Plan) -> Plan:
        """``plan`` with the intervals it leaves open chosen from a probe of the model."""
        T, B = int(x.shape[0]), int(x.shape[1])
        key = (plan, T, B)
        if key not in self.filled:
            with recompute_phase():  # probing re-runs steps: layers skip their side effects
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

    def _budget_chunk(self, model: Planned, x: Tensor, state: Any, budget: int) -> int:
        """The largest layer-wise chunk whose modeled peak fits ``budget`` less the parameters'
        accumulated gradients (cached per shape). Measured on a 200-256-10 snnTorch stack,
        disk tier, chunks of 9 to 40 steps: the peak was within 5% of that sum (the store
        entries and one block's fresh gradients included)."""
        T, B = int(x.shape[0]), int(x.shape[1])
        if (T, B) not in self.chunks:
            found = layerwise_candidate(model, x, state, required=True)
            assert found is not None
            sizes, working = found.sizes, found.working
            remote = model.storage != "device"
            grads = sum(
                p.numel() * p.element_size() for p in model.parameters_for_scan() if p.requires_grad
            )
            chunk = fitting_chunk(T, sizes, budget - grads, T, remote=remote, working=working)
            if chunk is None:
                cost = layerwise_cost(T, 1, sizes, remote=remote, working=working)
                smallest = cost.peak_bytes + grads
                raise plans.BudgetTooSmall(
                    f"layer-wise: not even chunks of one step fit {format_bytes(budget)} for "
                    f"T={T}, B={B} with {format_bytes(grads)} of gradients; the smallest budget "
                    f"that fits is {format_bytes(smallest)} ({smallest} bytes)",
                    budget_bytes=budget,
                    minimum_bytes=smallest,
                )
            self.chunks[(T, B)] = chunk
        return self.chunks[(T, B)]

    def decide(self, model: Planned, x: Any, state: Any) -> Decision:
        """The :class:`Decision` for input ``x`` ``(T, B, ...)`` (a tensor or a packed train)
        from ``state``."""
        if isinstance(self.plan, str) and self.plan == "auto" and self.budget is not None:
            return self._within_budget(model, x, state, self.budget)
        plan, budget = self._plan_for(model, x)
        T = int(x.shape[0])
        if isinstance(plan, Plan):
            if needs_intervals(plan) and self.granularity != "layer":
                plan = self._filled(model, x, state, plan)
            plan = plan.for_length(T)  # the intervals it runs with, for T
        if self.granularity == "stack":
            return Decision("stack", plan, budget=budget)
        if self.granularity == "layer":
            model.layer_blocks(True)  # raises UnsupportedLayerError saying why it cannot
            if self.chunk is not None:
                chunk = self.chunk
            elif budget is not None:
                chunk = self._budget_chunk(model, x, state, budget)
            else:
                chunk = chunk_for(plan, T)
            return Decision("layer", plan, min(chunk, T), budget)
        if not layerwise_may_pay(model, x):
            return Decision("stack", plan, budget=budget)
        key = (T, int(x.shape[1]))
        if key not in self.decisions:
            self.decisions[key] = self._auto(model, x, state, plan, budget)
        return self.decisions[key]

    def _within_budget(self, model: Planned, x: Any, state: Any, budget: int) -> Decision:
        """``plan="auto"`` with a budget: the step model :class:`MemoryBudget` plans with
        (:class:`BudgetPlanner`: input on the device, outputs, gradient buffers, activations),
        plus the parameters' ``.grad`` that the first backward creates, all within ``budget``.
        A refusal names the budget that works when passed back to ``wrap``."""
        if self.budgeted is None:
            params = [p for p in model.parameters_for_scan() if p.requires_grad]
            grads = trainable_bytes(params)
            planner = BudgetPlanner(max(budget - grads, 0), remote=model.storage != "device")
            planner.total_for = lambda need: need + grads
            planner.asked_bytes = budget
            planner.context = f"; the parameters' .grad take {format_bytes(grads)} more"
            self.budgeted = planner
        decision = self.budgeted.decide(model, x, state)
        if decision.granularity == "layer":
            self.decisions[(int(x.shape[0]), int(x.shape[1]))] = decision
        return decision

    def _auto(self, model: Planned, x: Any, state: Any, plan: Any, budget: int | None) -> Decision:
        found = layerwise_candidate(model, x, state, False, budgeted=False)
        if found is None:
            return Decision("stack", plan, budget=budget)
        T = int(x.shape[0])
        chunk = layer_or_stack(
            T,
            found.sizes,
            plan,
            limit=budget,
            remote=model.storage != "device",
            chunk=self.chunk,
        )
        if chunk is None:
            return Decision("stack", plan, budget=budget)
        return Decision("layer", plan, chunk, budget)
