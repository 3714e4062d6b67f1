"""The budget planner: a plan per input shape so that a wrapped model's training step fits a
device memory budget (what ``wrap(..., budget=...)`` and
[`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget] install).

The step is counted by the one account of [`spikeckpt.plans.account`][spikeckpt.plans.account]
([`StepBytes`][spikeckpt.plans.account.StepBytes]): the stack's plan is chosen (or, given, checked)
by [`choose_step`][spikeckpt.plans.account.choose_step] / [`check_step`][spikeckpt.plans.account.check_step],
the same functions ``scan(plan="auto", budget=...)`` calls on the same measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn, cast

import torch
from torch import Tensor

from spikeckpt import plans
from spikeckpt.engine import tree as pytree
from spikeckpt.engine.amp import cached_cast_bytes
from spikeckpt.engine.grad import grads_held, tensor_hooks_held
from spikeckpt.engine.inputs import input_grad_nbytes, input_nbytes, packing_hint
from spikeckpt.engine.meter import MemoryMeter
from spikeckpt.engine.rng import kept_generators
from spikeckpt.errors import BudgetTooSmall, SlowPlanWarning, warn_in_callers_code
from spikeckpt.planning.choice import (
    Decision,
    PlanCache,
    PlanChoice,
    Planned,
    autocast_mode,
    choice_from_dict,
    choice_to_dict,
    longer_within,
    model_signature,
    refuse_stateless,
)
from spikeckpt.planning.granularity import (
    LAYERWISE_TIME_TOLERANCE,
    fitting_layer_chunk,
    layerwise_candidate,
    layerwise_may_pay,
    least_layerwise,
    smallest_probed_layerwise,
)
from spikeckpt.planning.layer_working import (
    device_bytes,
    scaled_sizes,
)
from spikeckpt.planning.measured import Measured, roomier
from spikeckpt.planning.probe import (
    Probe,
    apart_under_autocast,
    compute_device,
    probe_model,
    shaped_state,
    step_work_bytes,
)
from spikeckpt.plans import CostModel
from spikeckpt.plans.account import (
    StepBytes,
    StepSizes,
    check_step,
    choose_step,
    grads_note,
    host_is_device,
    join_notes,
    refusal,
    slow_note,
    tier_note,
)
from spikeckpt.plans.choose import minimum_budget
from spikeckpt.plans.intervals import fill, needs_intervals
from spikeckpt.plans.layerwise import layerwise_cost
from spikeckpt.units import format_bytes, parse_bytes

__all__ = ["BudgetPlanner"]

#: probes of a call at the budget a refusal names, to check it (`BudgetPlanner._held_under`)
VERIFY_ROUNDS = 4

#: rounds of `BudgetPlanner._planning_bytes` (its probes measure more lengths as the budget
#: grows; each round runs them once)
PLANNING_ROUNDS = 3


class BudgetPlanner:
    """Choose and cache a plan per input shape so a wrapped model's step fits ``budget``.

    The first time it sees an input shape it probes the model (`probe_model`, held under
    the budget; with ``granularity="layer"`` or ``"auto"`` also the layer-wise working set,
    `layerwise_working_bytes`), counts what a training step holds
    ([`StepBytes`][spikeckpt.plans.account.StepBytes]: the input train while on the device,
    the stacked outputs and their gradient, the gradients, the plan's activations),
    picks the plan with the least modeled time whose step fits
    ([`choose_step`][spikeckpt.plans.account.choose_step]; layer-wise: the largest chunk that fits),
    and caches it for that shape. A plan given (``plan=Uniform(10)``) is checked instead
    ([`check_step`][spikeckpt.plans.account.check_step]) and refused when its step does not fit.
    When the storage tier is the device's own memory (the device tier; the host tier on a CPU
    run), stored checkpoints and trains count as activations, no plan with off-device
    checkpoints is chosen, and the plan's summary and refusals say so.

    Args:
        budget: device bytes (int or a string like ``"2GiB"``) for the step.
        remote: allow plans with off-device checkpoints (needs ``storage`` host or disk).
        costs: fixed operation times; None measures them with the probe.
        plan: ``"auto"`` (choose), or a plan to check against the budget (intervals left
            open are filled from the probe first).
        grad_in_step: the parameters' ``.grad`` is part of the step (``wrap``); False when
            the caller counts it with the model (``MemoryBudget``).
        total_for: for a caller that counts budgets otherwise (``MemoryBudget``: with the
            model and a margin): ``bytes this planner needs -> the budget to ask for``; a
            refusal names that budget.
        asked_bytes: the caller's budget, for messages (None: ``budget``).
        context: added to a refusal's account of what a step needs.
        reduce_max: a distributed caller's ``int -> int`` max over ranks (``T``, batch).
        broadcast: a distributed caller's ``obj -> rank 0's obj``: rank 0's measurements are
            used, so every rank chooses the same plan.

    Attributes:
        choices: shape ``(T, B)`` -> `PlanChoice`, under the autocast state now.
        probes: how many probes ran (a resumed run with known shapes runs none).
        runs: forwards with autograd it decided (``MemoryBudget`` counts them per step).
        last: the latest `PlanChoice`.
    """

    def __init__(
        self,
        budget: int | str,
        *,
        remote: bool = True,
        costs: CostModel | None = None,
        plan: Any = "auto",
        grad_in_step: bool = True,
        total_for: Callable[[int], int] | None = None,
        asked_bytes: int | None = None,
        context: str = "",
        reduce_max: Callable[[int], int] | None = None,
        broadcast: Callable[[Any], Any] | None = None,
    ) -> None:
        self.budget_bytes = parse_bytes(budget)
        self.remote = remote
        self.costs = costs
        self.plan = plan
        self.grad_in_step = grad_in_step
        self.total_for = total_for
        self.asked_bytes = asked_bytes
        self.context = context
        self.reduce_max = reduce_max
        self.broadcast = broadcast
        self.choices = PlanCache()
        #: `model_signature` of the model the choices were made for (None: not known yet)
        self.signature: tuple[Any, ...] | None = None
        self.probes = 0
        self.runs = 0
        self.last: PlanChoice | None = None
        #: whether the call being planned began with the parameters' ``.grad`` held
        self.grads_held = False
        #: blocks (by name) whose input train a run stored dense where a plan counted it
        #: bit-packed (a graded neuron below, found only once it fired): counted dense since
        self.graded: set[str] = set()

    def replan(self, budget_bytes: int, *, context: str = "") -> None:
        """Plan again with ``budget_bytes`` from the next forward on (every shape), adding
        ``context`` to refusals (once)."""
        self.budget_bytes = max(int(budget_bytes), 0)
        self.choices.clear()
        if context and context not in self.context:
            self.context += context

    def decide(self, model: Planned, x: Tensor, state: Any) -> Decision:
        """The `Decision` for input ``x`` ``(T, B, ...)`` (time first) from ``state``; plans
        are kept per shape and autocast state. A forward without autograd (``torch.no_grad``:
        validation, test, predict), or with nothing to differentiate (a frozen model on an
        input without gradient: a teacher), tapes nothing: it runs as plain BPTT (no probe,
        nothing planned or cached, no cross-rank agreement needed), whatever its shape."""
        if not torch.is_grad_enabled() or not _differentiates(model, x, state):
            return Decision("stack", plans.BPTT())
        self._check_stored_trains(model)
        signature = model_signature(model)
        if signature != self.signature:  # measured on another model: plan every shape again
            if self.signature is not None:
                self.choices.clear()
            self.signature = signature
        self.runs += 1
        T, batch = int(x.shape[0]), int(x.shape[1])
        if self.reduce_max is not None:
            T, batch = self.reduce_max(T), self.reduce_max(batch)
        key = (T, batch)
        self.choices.switch(autocast_mode(compute_device(model, x).type))
        here = self._input_here(model, x)
        if self.reduce_max is not None:  # every rank takes the same plan of a longer length
            here = self.reduce_max(here)
        self._reuse_longer(T, batch, here)
        # an input larger than planned with (denser, a full tensor for a view: 1.4-15x over)
        missing = key not in self.choices or here > self.choices[key].step.input
        if self.reduce_max is not None:
            # Planning broadcasts rank 0's probe, so every rank plans together: when any lacks
            # a plan (a new shape, a re-plan after running out of memory), all re-plan, on the
            # smallest budget of all ranks.
            missing = bool(self.reduce_max(int(missing)))
            if missing:
                self.budget_bytes = -self.reduce_max(-self.budget_bytes)
        choice = self.choices.get(key)
        params = model.parameters_for_scan()
        held = self.grad_in_step and grads_held(params)
        if choice is not None and held and not choice.grads_held:
            # planned with .grad None (the running sums become it): held now, both count
            missing = True
        self.grads_held = held
        if missing or choice is None:
            # the probes' gradients are not yours, nor are their draws from your layers' own
            # generators (a BPTT() with a budget differed from the loop by the probes' draws)
            seen = [length for length, size in self.choices if size == batch]
            longer = any(length != T for length in seen)
            with tensor_hooks_held(params), kept_generators(model):
                choice = self._plan(model, x, state, T, batch, roomy=bool(seen), longer=longer)
            self.choices[key] = choice
        self.last = choice
        return Decision(choice.granularity, choice.plan, choice.chunk, choice=choice)

    def _input_here(self, model: Planned, x: Any) -> int:
        """Bytes of the input ``x`` the step holds on the device, with the gradient it hands
        back for ``x`` where ``x`` requires grad (as the account counts them)."""
        if x.device != compute_device(model, x):
            return 0
        return input_nbytes(x) + input_grad_nbytes(x)

    def _reuse_longer(self, T: int, batch: int, here: int) -> None:
        """Where no plan for ``(T, batch)`` holds an input of ``here`` bytes, take one planned
        for a longer length that does (a plan of a longer length keeps the budget)."""
        planned = self.choices.get((T, batch))
        if planned is None or here > planned.step.input:
            longer = self._planned_longer(T, batch, here)
            if longer is not None:
                self.choices[(T, batch)] = longer

    def _planned_longer(self, T: int, batch: int, here: int) -> PlanChoice | None:
        """The choice planned (not reused) for the shortest length from ``T`` up to
        `REUSE_SPAN` times it at this batch whose input holds at least ``here`` bytes (a
        re-plan's roomier one: `Measured.roomy`), or None."""
        planned = {(c.T, c.batch): c for c in self.choices.values() if here <= c.step.input}
        key = longer_within(planned, T, batch, own=True)
        return planned[key] if key is not None else None

    def _check_stored_trains(self, model: Planned) -> None:
        """After a layer-wise run of this planner's `last` choice: where a block's input
        train was counted bit-packed and the run found it not binary (stored dense, the step
        over its budget), warn, count it dense from now on and plan every shape again."""
        last, decision = self.last, getattr(model, "last_decision", None)
        stats = getattr(model, "last_stats", None)
        if last is None or decision is None or decision.choice is not last or stats is None:
            return
        blocks = stats.blocks
        found = [
            blocks[i].name
            for i in last.packed_inputs
            if i < len(blocks) and not blocks[i].binary and blocks[i].name not in self.graded
        ]
        if not found:
            return
        self.graded.update(found)
        self.choices.clear()
        names = ", ".join(repr(n) for n in found)
        self.context += f"; the spike train into layer(s) {names} turned graded: counted dense"
        warn_in_callers_code(
            f"spikeckpt: the spike train into layer(s) {names} was planned bit-packed (the "
            "neuron below put out only 0 and 1 when the budget was planned) and the last run "
            "found other values (graded spikes): it was stored dense, and that step may have "
            "exceeded the budget. Planning again with it dense from this call on."
        )

    def layer_within(
        self, model: Planned, x: Any, state: Any, chunk: int | None, slack: float = 1.0
    ) -> int | None:
        """``granularity="auto"`` without a budget, this planner's ``plan`` given (a `Plan`):
        the chunk of the layer-wise run whose modeled whole step fits the plan's own (where
        none does, the least layer-wise step, if at most ``slack`` times it) and whose time,
        calibrated by the measured chunks, is at most `LAYERWISE_TIME_TOLERANCE` above the
        plan's; None: the stack plan runs."""
        T, batch = int(x.shape[0]), int(x.shape[1])
        with tensor_hooks_held(model.parameters_for_scan()), kept_generators(model):
            m = self._measure(model, x, state, T, batch)  # the probes' gradients, draws
        stack = self._stack_choice(m)
        if stack is None or m.blocks is None:
            return None
        self.budget_bytes = stack.step.total
        layer = self._layer_best(m, chunk, probed=False)  # no budget held the probes
        if layer is None and m.working is not None:  # the least layer-wise step, if near
            least = least_layerwise(m.T, m.blocks, m.working, remote=not m.on_device, chunk=chunk)
            if m.layer_base.total + least <= stack.step.total * slack:
                self.budget_bytes = m.layer_base.total + least
                layer = self._layer_best(m, chunk, probed=False)
        fast = stack.modeled.time * (1 + LAYERWISE_TIME_TOLERANCE)
        return layer.chunk if layer is not None and layer.modeled.time <= fast else None

    def _plan(
        self,
        model: Planned,
        x: Any,
        state: Any,
        T: int,
        batch: int,
        *,
        roomy: bool = False,
        longer: bool = False,
    ) -> PlanChoice:
        """Probe the model and choose, so that the step's planned peak fits the budget;
        ``roomy`` (a batch size planned before): for a denser input (``longer``: a batch size
        met at another length too, and longer) where that is about as fast
        (`Measured.roomy`), so that the batches around this one reuse it."""
        state = shaped_state(model, x, state)
        m = self._measure(model, x, state, T, batch)
        choice = self._choose(model, m)
        if choice is None:
            self._refuse_all(model, x, state, m)
        if choice.granularity == "stack":
            self._warn_if_slow(m)
        return roomier(choice, self._choose(model, m.roomy(longer))) if roomy else choice

    def _choose(self, model: Planned, m: Measured) -> PlanChoice | None:
        """Layer-wise where it fits and is about as fast as the stack's plan, else the stack's
        plan that fits, else None."""
        stack = self._stack_choice(m) if model.granularity != "layer" else None
        layer = self._layer_best(m, model.chunk)
        if layer is not None and (
            stack is None
            or layer.modeled.time <= stack.modeled.time * (1 + LAYERWISE_TIME_TOLERANCE)
        ):
            return layer
        return stack

    def _warn_if_slow(self, m: Measured) -> None:
        """Warn ([`SlowPlanWarning`][spikeckpt.errors.SlowPlanWarning]) where the plan chosen
        for this budget is modeled above `SLOW_FACTOR` times BPTT's time, naming a budget
        modeled within `QUICK_FACTOR` (a plan given was asked for: no warning)."""
        remote, budget = self.remote and not m.remote_here, self.budget_bytes
        if isinstance(self.plan, str) and (
            slow := slow_note(m.T, m.sizes, budget, remote=remote, costs=m.costs, named=self._named)
        ):
            asked = self.asked_bytes if self.asked_bytes is not None else budget
            message = f"under the budget of {asked} bytes ({format_bytes(asked)}) for T={m.T}"
            warn_in_callers_code(f"spikeckpt: {message}, B={m.batch}, {slow}", SlowPlanWarning)

    def _measure(
        self, model: Planned, x: Any, state: Any, T: int, batch: int, *, share: bool = True
    ) -> Measured:
        """Probe the model (and its layer-wise blocks when they may run), held under the
        budget, agreed across ranks (``share``; else this rank's alone, measured as a
        distributed call measures them), scaled to ``batch``."""
        device = compute_device(model, x)
        on_device = host_is_device(model.storage, device.type)
        x_bytes = self._input_here(model, x)
        params = [p for p in model.parameters_for_scan() if p.requires_grad]
        # what the probes may hold at once: the call holds its input and state meanwhile
        held = self._held_bytes(model, x, state, device)
        # under autocast its cache keeps a cast of each weight beside the probes, and each
        # probe's backward makes a gradient of the cast (its dtype) before the float32 one
        room = max(self.budget_bytes - held - 2 * (casts := cached_cast_bytes(params, device)), 0)
        probe = probe_model(model, x, state, model.storage, max_bytes=room)

        def measured(probe: Probe, blocks: Any, working: Any, seconds: Any) -> Measured:
            if blocks is not None:
                blocks = [scaled_sizes(b, batch, probe.batch) for b in blocks]
            if working is not None:
                working = working.scaled(batch, probe.batch)
            probe = probe.scaled(batch)
            sizes = probe.sizes(
                params,
                input_bytes=x_bytes,
                stacked=model.readout is None,
                grad_in_step=self.grad_in_step,
            )
            refuse_stateless(sizes.state)
            sizes = apart_under_autocast(sizes, model.readout, probe, device)
            sizes = replace(sizes, grads_held=self.grads_held, casts=casts)
            return Measured(
                T=T,
                batch=batch,
                probe=probe,
                blocks=blocks,
                working=working,
                seconds=seconds,
                on_device=on_device,
                costs=self.costs or probe.costs(),
                sizes=sizes,
                note=tier_note(model.storage, device.type),
                held=held,
                grads_held=self.grads_held,
                casts=casts,
            )

        layered = None
        if model.granularity == "layer" or (
            model.granularity == "auto" and layerwise_may_pay(model, x)
        ):
            # a stack plan fits: layer-wise is measured only where one chunk step of it may
            # fit what the probes may hold (a chunk of one step measured past it would break
            # the budget the stack keeps); none fits: it is measured whatever it holds, as
            # the refusal names the smallest budget of either granularity
            stack_fits = (
                model.granularity == "auto"
                and self.broadcast is None  # ranks would decide apart
                and self._stack_choice(measured(probe, None, None, None)) is not None
            )
            layered = layerwise_candidate(
                model,
                x,
                state,
                model.granularity == "layer",
                max_bytes=room,
                skip_over=stack_fits,
                graded=self.graded,
            )
        self.probes += 1
        blocks = layered.sizes if layered is not None else None
        # layer-wise: the measured working set holds the running sums of the gradients
        working = layered.working if layered is not None else None
        seconds = layered.seconds if layered is not None else None
        if share and self.broadcast is not None:  # the times too: ranks chose apart by them
            probe, blocks, working, seconds = self.broadcast((probe, blocks, working, seconds))
        if share and self.reduce_max is not None:
            # the largest rank's input too, as its shape: ranks whose batches were shorter
            # planned another chunk or interval for the same key (chunk 15 and 17)
            x_bytes = self.reduce_max(x_bytes)
        return measured(probe, blocks, working, seconds)

    def _stack_plan(self, m: Measured) -> Any:
        """The plan given, its open intervals filled from the probe (None for ``"auto"``)."""
        plan = self.plan
        if isinstance(plan, str) or not isinstance(plan, plans.Plan):
            return None
        if needs_intervals(plan):
            plan = fill(
                plan,
                m.T,
                state_bytes=m.sizes.state,
                step_bytes=m.sizes.tape,
                costs=m.costs,
                remote=self.remote and not m.remote_here,
            )
        return plan

    def _stack_choice(self, m: Measured) -> PlanChoice | None:
        """The fastest stack plan whose step fits (the plan given, when it fits), or None."""
        given = self._stack_plan(m)
        try:
            if given is None:
                remote = self.remote and not m.remote_here
                found = choose_step(
                    m.T, m.sizes, self.budget_bytes, remote=remote, costs=m.costs, note=m.note
                )
            else:
                found = check_step(
                    m.T,
                    m.sizes,
                    given,
                    self.budget_bytes,
                    remote_on_device=m.remote_here,
                    costs=m.costs,
                    note=m.note,
                )
        except BudgetTooSmall:
            return None
        room = self.budget_bytes - replace(found.step, activations=0).total
        return PlanChoice(
            cast(plans.Plan, found.plan),  # choose_step's, or the Plan given, filled
            m.T,
            m.batch,
            room,
            m.probe,
            found.cost,
            step=found.step,
            note=m.note,
            grads_held=m.grads_held,
        )

    def _layer_best(
        self, m: Measured, chunk: int | None, *, probed: bool = True
    ) -> PlanChoice | None:
        """Layer-wise with the largest chunk (up to ``chunk``) whose modeled (calibrated) peak
        fits, or None; a chunk given must fit itself. ``probed``: the budget held the
        probes, and the working-set probe's first run must have fit it too."""
        if m.blocks is None:
            return None
        room = self.budget_bytes - m.held
        if probed and m.working is not None and m.working.probe_bytes > room:
            return None  # the probe's first run has no room under this budget
        base = m.layer_base
        budget = self.budget_bytes - base.total
        remote = not m.on_device
        if chunk is not None:
            cost = layerwise_cost(m.T, chunk, m.blocks, remote=remote, working=m.working)
            found: int | None = chunk if cost.peak_bytes <= budget else None
        else:
            found = fitting_layer_chunk(
                m.T, m.blocks, budget, m.T, remote=remote, working=m.working
            )
        if found is None:
            return None
        modeled = layerwise_cost(
            m.T,
            found,
            m.blocks,
            remote=remote,
            costs=m.costs,
            working=m.working,
            seconds=m.seconds,
        )
        packed = tuple(i for i, b in enumerate(m.blocks) if i > 0 and b.density is not None)
        return PlanChoice(
            plans.Uniform(modeled.chunk).for_length(m.T),
            m.T,
            m.batch,
            budget,
            m.probe,
            modeled,
            "layer",
            modeled.chunk,
            replace(base, activations=modeled.peak_bytes),
            note=m.note,
            packed_inputs=packed,
            grads_held=m.grads_held,
        )

    def _stack_need(
        self, model: Planned, x: Any, state: Any, m: Measured
    ) -> tuple[StepBytes, int, StepSizes]:
        """The stack's step beside its activations, the least activations it needs (of
        the plan given, or of any plan) and the sizes they come from. The probes were held under this budget; the work is
        measured without the cap, so that passed back, the capped probes of that run find a
        plan that fits (the stack's measure only grows with room)."""
        T, batch, sizes = m.T, m.batch, m.sizes
        work = sizes.work
        if m.probe.work_capped:
            local = int(x.shape[1])  # this rank's batch; A is planned for ``batch``
            a_local = -(-sizes.tape * local // batch)
            work = -(-step_work_bytes(model, x, state, a_local) * batch // local)
            work = max(work + sizes.work - m.probe.work_bytes, sizes.work)  # what sizes adds
        sizes = replace(sizes, work=work)
        given = self._stack_plan(m)
        if given is None:
            return sizes.beside(T), minimum_budget(T, sizes.state, sizes.tape) + work, sizes
        found = check_step(T, sizes, given, 1 << 62, remote_on_device=m.remote_here, costs=m.costs)
        return replace(found.step, activations=0), found.step.activations, sizes

    def _refuse_all(self, model: Planned, x: Any, state: Any, m: Measured) -> NoReturn:
        """Nothing fits: name the smallest budget that does (layer-wise: the lengths a probe
        held under the named budget measures are checked)."""
        T, batch = m.T, m.batch
        local = int(x.shape[1])
        needs: list[tuple[StepBytes, int, Any]] = []
        stack_sizes = None
        if model.granularity != "layer":
            beside, least, stack_sizes = self._stack_need(model, x, state, m)
            needs.append((beside, least, self._stack_plan(m)))
        if m.blocks is not None:
            full = layerwise_candidate(model, x, state, True)
            assert full is not None and full.working is not None  # the capped probe ran
            base = m.layer_base
            smallest = smallest_probed_layerwise(
                T,
                [scaled_sizes(b, batch, local) for b in full.sizes],
                full.working.scaled(batch, local),
                remote=not m.on_device,
                beside=base.total,
                unprobed=m.held,
                chunk=model.chunk,
            )
            smallest = self._held_under(model, x, state, m, base.total, smallest)
            needs.append((base, smallest, None))
        chosen = min(needs, key=lambda need: need[0].total + need[1])
        step, smallest, given = chosen
        what = f"{'layer-wise, ' if model.granularity == 'layer' else ''}T={T}, B={batch}"
        need = step.total + smallest
        planning = self._planning_bytes(model, x, state, need)
        slow = None
        if given is None and stack_sizes is not None and chosen is needs[0]:  # the stack's
            slow = slow_note(
                T,
                stack_sizes,
                need,
                remote=self.remote and not m.remote_here,
                costs=m.costs,
                named=lambda within: self._named(max(within, planning)),
            )
        packing = packing_hint([x], need) if 2 * step.input >= need else None  # on the device
        note = join_notes(m.note, packing)
        if self.grad_in_step and m.sizes.grads:
            note = join_notes(note, grads_note(m.sizes.grads, m.grads_held))
        if planning > need:  # the first call's probes hold more than its step
            smallest += planning - need
            need = planning
            held = f"the probes of a call's planning hold {format_bytes(planning)} at once"
            note = f"{note}; {held}" if note else held
        raise refusal(
            self.budget_bytes,
            step,
            smallest,
            what=what,
            asked=self.asked_bytes,
            minimum=self._named(need),
            note=note,
            context=self.context,
            plan=given,
            after=f"where {slow}" if slow else None,
        )

    def _named(self, need: int) -> int:
        """The budget a caller names for a step of ``need`` bytes (`total_for`'s)."""
        return self.total_for(need) if self.total_for is not None else need

    def _held_under(
        self, model: Planned, x: Any, state: Any, m: Measured, beside: int, smallest: int
    ) -> int:
        """The layer-wise ``smallest`` (bytes beside ``beside``) that a call given ``beside +
        smallest`` plans with: its probes, held under that budget, may stop at fewer chunk
        lengths than `smallest_probed_layerwise` counts (the probe's limit predicts a longer
        one over the room) and model more; raised to what they model, at most
        `VERIFY_ROUNDS` times (a named 618,628 B was refused when passed back: 16 KB more
        modeled at the shortest chunk that fit)."""
        for _ in range(VERIFY_ROUNDS):
            trial = BudgetPlanner(
                beside + smallest,
                remote=self.remote,
                costs=self.costs,
                plan=self.plan,
                grad_in_step=self.grad_in_step,
            )
            trial.graded, trial.grads_held = set(self.graded), self.grads_held
            got = trial._measure(model, x, state, m.T, m.batch, share=False)
            if got.blocks is None or got.working is None:
                return smallest
            if trial._layer_best(got, model.chunk) is not None:
                return smallest
            least = least_layerwise(
                m.T, got.blocks, got.working, remote=not got.on_device, chunk=model.chunk
            )
            first = got.working.probe_bytes + got.held - beside
            smallest = max(smallest + 1, least, first)
        return smallest

    def _held_bytes(self, model: Planned, x: Any, state: Any, device: torch.device) -> int:
        """Device bytes the call holds while it plans: its input and state, and ``.grad``
        where it is held and counted in the step."""
        held = (input_nbytes(x) if x.device == device else 0) + device_bytes(state, device)
        if self.grad_in_step and self.grads_held:
            held += device_bytes([p.grad for p in model.parameters_for_scan()], device)
        return held

    def _planning_bytes(self, model: Planned, x: Any, state: Any, budget: int) -> int:
        """Device bytes a call planning under ``budget`` holds at once, its input and state
        included, raised until its probes (held under ``budget``, so they measure more as it
        grows) fit it (at most `PLANNING_ROUNDS` rounds): the smallest budget a refusal
        names is one whose first call keeps it, probes and all."""
        device = compute_device(model, x)
        held = self._held_bytes(model, x, state, device)
        T, batch = int(x.shape[0]), int(x.shape[1])
        saved = self.budget_bytes, self.probes
        try:
            for _ in range(PLANNING_ROUNDS):
                self.budget_bytes = budget
                with MemoryMeter(device) as meter:
                    self._measure(model, x, state, T, batch, share=False)  # no collective
                if held + meter.peak_bytes <= budget:
                    break
                budget = held + meter.peak_bytes
        finally:
            self.budget_bytes, self.probes = saved
        return budget

    def state_dict(self) -> dict[str, Any]:
        """Budget and chosen plans per shape, as plain dicts, lists and numbers (loadable with
        ``torch.load(weights_only=True)``, as Lightning loads checkpoints)."""
        return {
            "budget_bytes": self.budget_bytes,
            # a choice reused for shorter lengths once, under the length it was planned for
            "choices": self.choices.to_dicts(choice_to_dict),
            "graded": sorted(self.graded),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the chosen plans; they are kept only if the budget is the same."""
        if state.get("budget_bytes") != self.budget_bytes:
            return
        self.graded.update(state.get("graded", []))
        self.choices.load_dicts(state.get("choices", []), choice_from_dict)


def _differentiates(model: Planned, x: Any, state: Any) -> bool:
    """Whether a forward of ``model`` on ``x`` from ``state`` records anything for autograd:
    a tensor it differentiates, the input or a state leaf requires grad."""
    if isinstance(x, Tensor) and x.requires_grad:
        return True
    if any(t.requires_grad for t in model.parameters_for_scan()):
        return True
    leaves = pytree.tree_leaves(state)
    return any(isinstance(t, Tensor) and t.requires_grad for t in leaves)
