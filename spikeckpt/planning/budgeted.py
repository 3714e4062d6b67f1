"""The budget planner: a plan per input shape so that a wrapped model's training step fits a
device memory budget (what :class:`~spikeckpt.lightning.MemoryBudget` and ``wrap(plan="auto",
budget=...)`` install).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple, NoReturn

from torch import Tensor

from spikeckpt import plans
from spikeckpt.engine.packed import input_nbytes
from spikeckpt.planning.choice import (
    Decision,
    PlanChoice,
    Planned,
    StepBytes,
    choice_from_dict,
    choice_to_dict,
)
from spikeckpt.planning.granularity import (
    LAYERWISE_TIME_TOLERANCE,
    fitting_layer_chunk,
    host_is_device,
    layerwise_candidate,
    layerwise_may_pay,
    smallest_probed_layerwise,
)
from spikeckpt.planning.probe import (
    Probe,
    compute_device,
    probe_model,
    scaled_sizes,
    step_work_bytes,
    trainable_bytes,
)
from spikeckpt.plans import CostModel, choose
from spikeckpt.plans.choose import minimum_budget
from spikeckpt.plans.layerwise import (
    BlockSizes,
    MeasuredWorking,
    layerwise_cost,
)
from spikeckpt.units import format_bytes, parse_bytes

__all__ = ["BudgetPlanner"]

ShapeKey = tuple[int, int]


class _Measured(NamedTuple):
    """What a :class:`BudgetPlanner` measured for one input shape, scaled to its batch."""

    T: int
    batch: int
    probe: Probe
    sizes: list[BlockSizes] | None
    working: MeasuredWorking | None
    on_device: bool
    costs: CostModel
    base: StepBytes
    grads: int
    largest_param: int


class BudgetPlanner:
    """Choose and cache a plan per input shape so a wrapped model fits ``budget`` bytes.

    The first time it sees an input shape it probes the model
    (:func:`~spikeckpt.planning.probe.probe_model`, held under the budget; for a model wrapped
    with ``granularity="layer"`` or ``"auto"`` also the layer-wise working set,
    :func:`~spikeckpt.planning.probe.layerwise_working_bytes`), models what a training step
    holds (:class:`StepBytes`: the input train while it is on the device, the stacked
    outputs and their gradient, the engine's gradient buffers, the plan's activations),
    picks the plan with the least modeled time whose step fits with
    :func:`spikeckpt.plans.choose` (layer-wise: the largest chunk that fits), and caches it
    for that shape. When the storage tier is the device's own memory (the device tier; the
    host tier on a CPU run), stored checkpoints and trains count as activations and no plan
    with off-device checkpoints is chosen.

    Across processes (DDP) the planner agrees with the other ranks through two functions set by
    the caller: ``reduce_max`` (the planned ``T`` and batch are the largest over the ranks) and
    ``broadcast`` (rank 0's measurements are used), so every rank chooses the same plan.

    Args:
        budget: device bytes (int or a string like ``"2GiB"``) for what this model's step
            holds beyond the model itself (:class:`StepBytes`).
        remote: allow plans with off-device checkpoints (needs ``storage`` host or disk).
        costs: fixed operation times; None measures them with the probe.

    Attributes:
        choices: shape ``(T, B)`` -> :class:`PlanChoice`.
        probes: how many probes ran (a resumed run with known shapes runs none).
        reduce_max: set by a distributed caller: ``int -> int`` max over ranks.
        broadcast: set by a distributed caller: ``obj -> rank 0's obj``.
        last: the latest :class:`PlanChoice`.
        total_for: set by a caller that counts budgets otherwise (``MemoryBudget``: with the
            model and a margin): ``bytes this planner needs -> the budget to ask for``; a
            refusal names that budget.
        asked_bytes: the caller's budget, for messages (None: ``budget_bytes``).
        context: appended to a refusal's account of what a step needs.
    """

    def __init__(
        self, budget: int | str, *, remote: bool = True, costs: CostModel | None = None
    ) -> None:
        self.budget_bytes = parse_bytes(budget)
        self.remote = remote
        self.costs = costs
        self.choices: dict[ShapeKey, PlanChoice] = {}
        self.probes = 0
        self.reduce_max: Callable[[int], int] | None = None
        self.broadcast: Callable[[Any], Any] | None = None
        self.last: PlanChoice | None = None
        self.total_for: Callable[[int], int] | None = None
        self.asked_bytes: int | None = None
        self.context = ""

    def decide(self, model: Planned, x: Tensor, state: Any) -> Decision:
        """The :class:`Decision` for input ``x`` ``(T, B, ...)`` (time first) from ``state``."""
        T, batch = int(x.shape[0]), int(x.shape[1])
        if self.reduce_max is not None:
            T, batch = self.reduce_max(T), self.reduce_max(batch)
        key = (T, batch)
        missing = key not in self.choices
        if self.reduce_max is not None:
            # Planning broadcasts rank 0's probe, so every rank must plan together: when any
            # rank lacks a plan (a new shape, or a re-plan after running out of memory), all
            # re-plan, on the smallest budget of all ranks.
            missing = bool(self.reduce_max(int(missing)))
            if missing:
                self.budget_bytes = -self.reduce_max(-self.budget_bytes)
        choice = self.choices.get(key)
        if missing or choice is None:
            choice = self._plan(model, x, state, T, batch)
            self.choices[key] = choice
        self.last = choice
        return Decision(choice.granularity, choice.plan, choice.chunk, choice=choice)

    def _plan(self, model: Planned, x: Any, state: Any, T: int, batch: int) -> PlanChoice:
        """Probe the model and choose, so that the step's planned peak (:class:`StepBytes`:
        input, outputs, gradient buffers, activations) fits :attr:`budget_bytes`."""
        m = self._measure(model, x, state, T, batch)
        stack = self._stack_choice(m) if model.granularity != "layer" else None
        layer = self._layer_best(m, model.chunk if model.chunk is not None else T)
        if layer is not None and (
            stack is None
            or layer.modeled.time <= stack.modeled.time * (1 + LAYERWISE_TIME_TOLERANCE)
        ):
            return layer
        if stack is not None:
            return stack
        self._refuse_all(model, x, state, m)

    def _measure(self, model: Planned, x: Any, state: Any, T: int, batch: int) -> _Measured:
        """Probe the model (and its layer-wise blocks when they may run), held under the
        budget, agreed across ranks, scaled to ``batch``."""
        device = compute_device(model, x)
        on_device = host_is_device(model.storage, device)
        x_bytes = input_nbytes(x) if x.device == device else 0
        params = [p for p in model.parameters_for_scan() if p.requires_grad]
        room = max(self.budget_bytes - x_bytes, 0)  # what the probes may hold at once
        probe = probe_model(model, x, state, model.storage, max_bytes=room)
        layered = None
        if model.granularity == "layer" or (
            model.granularity == "auto" and layerwise_may_pay(model, x)
        ):
            layered = layerwise_candidate(
                model, x, state, model.granularity == "layer", max_bytes=room
            )
        self.probes += 1
        sizes = layered.sizes if layered is not None else None
        # layer-wise: the measured working set holds the running sums of the gradients
        working = layered.working if layered is not None else None
        if self.broadcast is not None:
            probe, sizes, working = self.broadcast((probe, sizes, working))
        if sizes is not None:
            sizes = [scaled_sizes(b, batch, probe.batch) for b in sizes]
        if working is not None:
            working = working.scaled(batch, probe.batch)
        probe = probe.scaled(batch)
        outputs = 2 * T * probe.output_bytes if model.readout is None else 0
        return _Measured(
            T=T,
            batch=batch,
            probe=probe,
            sizes=sizes,
            working=working,
            on_device=on_device,
            costs=self.costs or probe.costs(),
            base=StepBytes(input=x_bytes, outputs=outputs),
            grads=trainable_bytes(params),
            largest_param=max((p.numel() * p.element_size() for p in params), default=0),
        )

    def _stack_step(self, m: _Measured) -> StepBytes:
        """The stack's step beyond its activations: the input, the outputs, and while the
        engine sums the parameters' gradients over segments, a segment's own gradients
        beside the running sum, and one parameter's new sum when it is made out of place."""
        return replace(m.base, gradients=m.grads + m.largest_param)

    def _stack_choice(self, m: _Measured) -> PlanChoice | None:
        """The fastest stack plan whose step fits (None when none does): its plan's peak and
        one step's working memory beside :meth:`_stack_step`."""
        T, probe = m.T, m.probe
        S, A, work = probe.state_bytes, probe.step_bytes, probe.work_bytes
        stack_step = self._stack_step(m)
        stack_budget = self.budget_bytes - stack_step.total
        remote = self.remote and not m.on_device
        try:
            plan = choose(T, S, A, max(stack_budget - work, 0), remote=remote, costs=m.costs)
        except plans.BudgetTooSmall:
            return None
        plan = plan.for_length(T)
        modeled = plan.cost(T, state_bytes=S, step_bytes=A, costs=m.costs)
        activations = replace(stack_step, activations=modeled.peak_bytes + work)
        if isinstance(plan, plans.BPTT):  # one backward call: no running sum
            activations = replace(activations, gradients=m.grads)
        return PlanChoice(plan, T, m.batch, stack_budget, probe, modeled, step=activations)

    def _layer_best(self, m: _Measured, preferred: int) -> PlanChoice | None:
        """Layer-wise with the largest chunk whose modeled (calibrated) peak fits, or None."""
        if m.sizes is None:
            return None
        layer_budget = self.budget_bytes - m.base.total
        chunk = fitting_layer_chunk(
            m.T, m.sizes, layer_budget, preferred, remote=not m.on_device, working=m.working
        )
        if chunk is None:
            return None
        modeled = layerwise_cost(
            m.T, chunk, m.sizes, remote=not m.on_device, costs=m.costs, working=m.working
        )
        plan = plans.Uniform(modeled.chunk).for_length(m.T)
        return PlanChoice(
            plan,
            m.T,
            m.batch,
            layer_budget,
            m.probe,
            modeled,
            "layer",
            modeled.chunk,
            replace(m.base, activations=modeled.peak_bytes),
        )

    def _refuse_all(self, model: Planned, x: Any, state: Any, m: _Measured) -> NoReturn:
        """Nothing fits: name the smallest budget that does. The probes were held under this
        budget; the minimum is measured without the cap, so that passed back, the capped
        probes of that run find a plan that fits (the stack's measure only grows with room;
        layer-wise, the lengths a probe held under the named budget measures are checked)."""
        T, batch, probe = m.T, m.batch, m.probe
        S, A, work = probe.state_bytes, probe.step_bytes, probe.work_bytes
        local = int(x.shape[1])  # this rank's batch; A is planned for ``batch``
        needs = []
        if model.granularity != "layer":
            if probe.work_capped:
                a_local = -(-A * local // batch)
                work = -(-step_work_bytes(model, x, state, a_local) * batch // local)
            needs.append((self._stack_step(m), minimum_budget(T, S, A) + work))
        if m.sizes is not None:
            full = layerwise_candidate(model, x, state, True)
            assert full is not None and full.working is not None  # the capped probe ran
            smallest = smallest_probed_layerwise(
                T,
                [scaled_sizes(b, batch, local) for b in full.sizes],
                full.working.scaled(batch, local),
                remote=not m.on_device,
                beside=m.base.total,
                unprobed=m.base.input,
            )
            needs.append((m.base, smallest))
        step, smallest = min(needs, key=lambda need: need[0].total + need[1])
        what = "layer-wise, " if model.granularity == "layer" else ""
        self._refuse(f"{what}T={T}, B={batch}", step, smallest)

    def _refuse(self, what: str, step: StepBytes, smallest: int) -> NoReturn:
        """Raise :class:`~spikeckpt.BudgetTooSmall` naming a budget that works when passed
        back: the step's input, outputs and gradient buffers plus the smallest plan's
        activations, as the caller counts budgets (:attr:`total_for`)."""
        need = step.total + smallest
        minimum = self.total_for(need) if self.total_for is not None else need
        asked = self.asked_bytes if self.asked_bytes is not None else self.budget_bytes
        parts = f"{step.beside()}, smallest plan {format_bytes(smallest)}"
        if self.budget_bytes <= step.total:
            head = f"the budget of {format_bytes(asked)} leaves nothing for activations"
        else:
            head = f"no checkpointing plan fits the budget of {format_bytes(asked)}"
        raise plans.BudgetTooSmall(
            f"{head} for {what}: a step needs {format_bytes(need)} beyond the model ({parts})"
            f"{self.context}; the smallest budget that fits is {format_bytes(minimum)} "
            f"({minimum} bytes)",
            budget_bytes=asked,
            minimum_bytes=minimum,
        )

    def state_dict(self) -> dict[str, Any]:
        """Budget and chosen plans per shape, as plain dicts, lists and numbers (loadable with
        ``torch.load(weights_only=True)``, as Lightning loads checkpoints)."""
        return {
            "budget_bytes": self.budget_bytes,
            "choices": [choice_to_dict(choice) for choice in self.choices.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the chosen plans; they are kept only if the budget is the same."""
        if state.get("budget_bytes") != self.budget_bytes:
            return
        for item in state.get("choices", []):
            choice = choice_from_dict(item)
            self.choices[(choice.T, choice.batch)] = choice
