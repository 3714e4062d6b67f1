"""A ``scan`` call's plan for a budget: one probe of the step and the one account of the step
([`spikeckpt.plans.account`][spikeckpt.plans.account]); a refusal raised once, with a packing
hint; a warning where the plan chosen recomputes steps many times over."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from spikeckpt.engine.grad import grads_held
from spikeckpt.engine.inputs import (
    input_grad_nbytes,
    input_nbytes,
    is_packed,
    step_of,
    with_packing_hint,
)
from spikeckpt.engine.measure import probe_step, work_bytes
from spikeckpt.engine.scan_options import ScanOptions, Timed
from spikeckpt.engine.tree import leaf_bytes
from spikeckpt.errors import BudgetTooSmall, SlowPlanWarning, warn_in_callers_code
from spikeckpt.plans.account import (
    StepBytes,
    StepChoice,
    StepSizes,
    check_step,
    choose_step,
    grads_note,
    host_is_device,
    join_notes,
    slow_note,
    tier_note,
)
from spikeckpt.plans.intervals import fill, needs_intervals
from spikeckpt.units import format_bytes, parse_bytes

__all__ = ["measured_plan"]


def measured_plan(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    timed: Timed,
    param_list: list[Tensor],
    options: ScanOptions,
    device: torch.device,
) -> tuple[Any, StepBytes | None]:
    """``"auto"`` chosen within the budget, open intervals filled, a plan checked against the
    budget: from one probe of the step (the measuring room) and the one account of the step
    ([`spikeckpt.plans.account`][spikeckpt.plans.account])."""
    in_leaves, in_def, T = timed
    storage, plan = options.storage, options.plan
    total = parse_bytes(options.budget) if options.budget is not None else None
    here = [leaf for leaf in in_leaves if leaf.device == device]  # counted in the step
    x_bytes = sum(input_nbytes(leaf) for leaf in here)
    held = grads_held(param_list)
    # what the call holds while the probe runs: its input on the device and a held .grad
    held_bytes = x_bytes + leaf_bytes([p.grad for p in param_list])
    x_bytes += sum(input_grad_nbytes(leaf) for leaf in here)  # and, after it, their gradient
    probe = probe_step(
        step,
        state,
        lambda t: in_def.unflatten([step_of(leaf, t, device) for leaf in in_leaves]),
        T,
        param_list,
        storage=storage,
        device=device,
        directory=options.directory,
        pack=options.pack_tape,
        max_bytes=max(total - held_bytes, 0) if total is not None else None,
        # input slices on the device are views of the inputs: no memory of the tape's
        exclude=[leaf for leaf in in_leaves if not is_packed(leaf) and leaf.device == device],
    )
    sizes = probe.sizes(param_list, input_bytes=x_bytes, stacked=options.readout is None)
    sizes = replace(sizes, grads_held=held)
    on_device = host_is_device(storage, device.type)
    costs = probe.costs()
    if isinstance(plan, str) or needs_intervals(plan):
        if not isinstance(plan, str):
            plan = fill(plan, T, state_bytes=sizes.state, step_bytes=sizes.tape, costs=costs,
                        remote=storage != "device")  # fmt: skip
        if total is None:
            return plan, None
    assert total is not None
    note = join_notes(
        tier_note(storage, device.type), grads_note(sizes.grads, held) if sizes.grads else None
    )

    def account(sizes: StepSizes) -> StepChoice:
        if isinstance(plan, str):
            return choose_step(T, sizes, total, remote=not on_device, costs=costs,
                               apart=options.apart, note=note)  # fmt: skip
        return check_step(T, sizes, plan, total, remote_on_device=on_device, costs=costs,
                          apart=options.apart, note=note)  # fmt: skip

    def remeasured(sizes: StepSizes) -> StepSizes:
        # the probe, held under this budget, measured the step's work without the parameters'
        # gradients: measure it with them, so the budget the refusal names works
        x0 = in_def.unflatten([step_of(leaf, 0, device) for leaf in in_leaves])
        work = work_bytes(step, state, x0, param_list, sizes.tape, device)
        return replace(sizes, work=max(work, sizes.work))

    choice, sizes = _fit(account, sizes, remeasured if probe.work_capped else None, here)
    if isinstance(plan, str):
        _warn_if_slow(T, sizes, total, remote=not on_device, costs=costs)
    return choice.plan, choice.step


def _fit(
    account: Callable[[StepSizes], StepChoice],
    sizes: StepSizes,
    remeasured: Callable[[StepSizes], StepSizes] | None,
    here: list[Any],
) -> tuple[StepChoice, StepSizes]:
    """``account(sizes)``; refused, once more with ``remeasured(sizes)`` where given. A
    refusal is raised once (not chained to the first), with `with_packing_hint` on ``here``
    (the inputs on the device)."""
    try:
        return account(sizes), sizes
    except BudgetTooSmall as error:
        if remeasured is None:
            raise with_packing_hint(error, here) from None
    sizes = remeasured(sizes)
    try:
        return account(sizes), sizes
    except BudgetTooSmall as error:
        raise with_packing_hint(error, here) from None


def _warn_if_slow(T: int, sizes: StepSizes, total: int, *, remote: bool, costs: Any) -> None:
    """Warn ([`SlowPlanWarning`][spikeckpt.errors.SlowPlanWarning]) where the plan chosen
    for a budget of ``total`` bytes recomputes steps many times over (`slow_note`)."""
    slow = slow_note(T, sizes, total, remote=remote, costs=costs)
    if slow is not None:
        warn_in_callers_code(
            f"spikeckpt: under the budget of {total} bytes ({format_bytes(total)}) for "
            f"T={T}, {slow}",
            SlowPlanWarning,
        )
