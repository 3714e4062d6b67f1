"""What planning decides: `Decision` (how one forward runs) and `PlanChoice` (a
plan chosen for a budget, and why, with the step it makes:
[`StepBytes`][spikeckpt.plans.account.StepBytes]), and `Planned`, what a planner needs of a
model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from spikeckpt import plans
from spikeckpt.engine.layerwise import LayerBlock
from spikeckpt.errors import ConfigError
from spikeckpt.planning.probe import (
    Probe,
    Probed,
)
from spikeckpt.plans import Cost, Plan
from spikeckpt.plans.account import StepBytes
from spikeckpt.plans.layerwise import (
    LayerwiseCost,
)
from spikeckpt.units import format_bytes

__all__ = [
    "REUSE_SPAN",
    "Decision",
    "PlanCache",
    "PlanChoice",
    "Planned",
    "StepBytes",
    "autocast_mode",
    "choice_from_dict",
    "choice_to_dict",
    "longer_within",
    "model_signature",
    "refuse_stateless",
]

ShapeKey = tuple[int, int]


class Planned(Probed, Protocol):
    """What a planner needs of a model (a [`CheckpointedSequence`][spikeckpt.wrapping.CheckpointedSequence] has it)."""

    storage: str
    readout: Any
    output: str
    granularity: str
    chunk: int | None

    def device_for(self, x: Any) -> Any:
        """The device ``x``'s steps run on (a packed train's: the model's)."""
        ...

    def initial_state(self, x_t: Tensor) -> Any:
        """The model's state at t=0 for one step's input ``x_t``."""
        ...

    def params_swapped(self) -> bool:
        """Whether parameters were swapped in for this call (``functional_call``)."""
        ...

    def layer_blocks(self, required: bool) -> list[LayerBlock] | None:
        """The model's layer-wise blocks; ``None`` when it does not split into them (or
        ``UnsupportedLayerError`` saying why when ``required``)."""
        ...

    def block_states(self, state: Any) -> list[Any]:
        """Each block's part of the model's state."""
        ...


@dataclass(frozen=True)
class PlanChoice:
    """A plan chosen for a budget, and why.

    Attributes:
        plan: the stack plan, intervals filled in for ``T`` (layer-wise: ``Uniform(chunk)``,
            the stack plan with the same step evaluations).
        T: steps planned for (a call up to `REUSE_SPAN` times shorter runs this plan: ``T``
            stays the length planned, the call's own length is its input's).
        batch: batch size planned for.
        budget_bytes: the device budget the plan's activations had to fit (the planner's
            budget less the input, the outputs and the gradient buffers of ``step``).
        probe: the measurements used.
        modeled: the modeled cost (counts, ``peak_bytes``, ``time`` in seconds): a
            [`Cost`][spikeckpt.plans.simulate.Cost], or a [`LayerwiseCost`][spikeckpt.plans.layerwise.LayerwiseCost].
        granularity: ``"stack"`` or ``"layer"``.
        chunk: layer-wise steps per chunk (None for the stack).
        step: what the training step holds, as planned
            ([`StepBytes`][spikeckpt.plans.account.StepBytes]); ``step.total`` is at most the
            planner's budget.
        note: which memory the storage tier is on a CPU run (None on a GPU).
        packed_inputs: layer-wise: the blocks (by position) whose input spike train was
            counted bit-packed (its neuron's output was exactly 0/1 when measured); a run
            that stores one of them dense makes the planner plan again.
        grads_held: planned for a call that began with ``.grad`` held (counted beside the
            step's own sums); a plan made without it is made again for such a call.
    """

    plan: Plan
    T: int
    batch: int
    budget_bytes: int
    probe: Probe
    modeled: Cost | LayerwiseCost
    granularity: str = "stack"
    chunk: int | None = None
    step: StepBytes = StepBytes()
    note: str | None = None
    packed_inputs: tuple[int, ...] = ()
    grads_held: bool = False

    @property
    def modeled_peak_bytes(self) -> int:
        """Modeled device peak of checkpoints and tapes (bytes)."""
        return self.modeled.peak_bytes

    @property
    def modeled_step_bytes(self) -> int:
        """The step's planned device peak beyond the model: input, outputs, gradient buffers
        and activations (``step.total``)."""
        return self.step.total

    @property
    def time_factor(self) -> float:
        """Modeled time relative to plain BPTT."""
        return self.modeled.time_factor(self.probe.costs())

    @property
    def recompute_factor(self) -> float:
        """Step evaluations per time step (1.0 for BPTT)."""
        return self.modeled.forward_steps / self.T

    def describe(self) -> str:
        """The plan as it runs: ``"Uniform(interval=32)"`` or ``"layer-wise(chunk=20)"``."""
        return f"layer-wise(chunk={self.chunk})" if self.granularity == "layer" else repr(self.plan)

    def __str__(self) -> str:
        """`summary`: ``print(callback.plans["net"])`` prints one line."""
        return self.summary()

    def summary(self) -> str:
        """One line: plan, modeled peak, what else the step holds, time factor."""
        step = self.step
        extra = ""
        if step.total > step.activations:
            extra = f" (+ {step.beside()})"
        return (
            f"{self.describe()} for T={self.T}, B={self.batch}: modeled peak "
            f"{format_bytes(self.modeled_peak_bytes)} of {format_bytes(self.budget_bytes)}"
            f"{extra}, {self.recompute_factor:.2f} evaluations/step, "
            f"~{self.time_factor:.2f}x BPTT time" + (f" ({self.note})" if self.note else "")
        )


@dataclass(frozen=True)
class Decision:
    """How one forward runs.

    Attributes:
        granularity: ``"stack"`` or ``"layer"``.
        plan: the stack plan (a plan, a ``Schedule``, or ``"auto"`` with ``budget``: the
            engine measures one step and chooses) ; for layer-wise, the plan it was compared to.
        chunk: layer-wise steps per chunk (None for the stack).
        budget: device bytes for ``plan="auto"`` (None otherwise).
        choice: the budget planner's `PlanChoice` (None for a model's own plan).
    """

    granularity: str
    plan: Any
    chunk: int | None = None
    budget: int | None = None
    choice: PlanChoice | None = None

    def describe(self) -> str:
        """The plan as it runs (``"Uniform(interval=32)"``, ``"layer-wise(chunk=20)"``)."""
        if self.granularity == "layer":
            return f"layer-wise(chunk={self.chunk})"
        return self.plan if isinstance(self.plan, str) else repr(self.plan)


def choice_to_dict(choice: PlanChoice) -> dict[str, Any]:
    plan_args = {k: v for k, v in vars(choice.plan).items() if not k.startswith("_")}
    return {
        "plan": {"type": type(choice.plan).__name__, "args": plan_args},
        "T": choice.T,
        "batch": choice.batch,
        "budget_bytes": choice.budget_bytes,
        "probe": asdict(choice.probe),
        "modeled": asdict(choice.modeled),
        "granularity": choice.granularity,
        "chunk": choice.chunk,
        "step": asdict(choice.step),
        "note": choice.note,
        "packed_inputs": list(choice.packed_inputs),
        "grads_held": choice.grads_held,
    }


def choice_from_dict(item: dict[str, Any]) -> PlanChoice:
    plan_class = getattr(plans, item["plan"]["type"])
    granularity = item.get("granularity", "stack")
    modeled_class = LayerwiseCost if granularity == "layer" else Cost
    return PlanChoice(
        plan=plan_class(**item["plan"]["args"]),
        T=item["T"],
        batch=item["batch"],
        budget_bytes=item["budget_bytes"],
        probe=Probe(**item["probe"]),
        modeled=modeled_class(**item["modeled"]),
        granularity=granularity,
        chunk=item.get("chunk"),
        step=StepBytes(**item.get("step", {})),
        note=item.get("note"),
        packed_inputs=tuple(item.get("packed_inputs", ())),
        grads_held=bool(item.get("grads_held", False)),
    )


def model_signature(model: Planned) -> tuple[Any, ...]:
    """What a plan measured on ``model`` depends on besides the input's shape: the shape,
    dtype and device of each tensor it differentiates and whether it requires grad. It changes
    with ``model.double()`` or ``.to(device)``, layers frozen or thawed (fine-tuning), a layer
    replaced by one of another size: the step's bytes change, so a plan chosen before may no
    longer fit the budget."""
    return tuple(
        (tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in model.parameters_for_scan()
    )


#: A new sequence length reuses what was planned for a longer one of the same batch, up to
#: this many times its own: every plan's step grows with ``T`` (its checkpoints, stored
#: trains, outputs and input), so a plan that keeps the budget at the longer length keeps it
#: here too. Data whose length varies per batch (SHD binned without a fixed duration: T
#: 239-250 over 12 batches) planned 8 lengths in 12 batches, 4.7 s of probes in 5.8 s.
REUSE_SPAN = 1.25


def longer_within(
    planned: Iterable[ShapeKey], T: int, batch: int, *, own: bool = False
) -> ShapeKey | None:
    """The shortest planned ``(T', batch)`` with ``T < T' <= REUSE_SPAN * T`` (``own``:
    ``T <= T'``; None: none)."""
    least = T if own else T + 1  # lengths are whole steps
    near = [key for key in planned if key[1] == batch and least <= key[0] <= T * REUSE_SPAN]
    return min(near) if near else None


#: autocast's state for a device type: on or off, and the dtype it casts to when on
AutocastMode = tuple[bool, "torch.dtype | None"]


def autocast_mode(device_type: str) -> AutocastMode:
    """Whether autocast is on for ``device_type`` (``"cpu"``, ``"cuda"``) and its dtype: a
    step under bf16 autocast holds other bytes (half-size activations, the cached casts of
    the weights) than the same step in float32."""
    if not torch.is_autocast_enabled(device_type):
        return (False, None)
    return (True, torch.get_autocast_dtype(device_type))


class PlanCache(dict[ShapeKey, "PlanChoice"]):
    """The plans chosen per ``(T, B)`` under the autocast state now (`switch`); those of other
    states are kept aside: a plan measured in float32 and run under bf16 autocast (Lightning's
    precision toggled, a step under ``torch.autocast`` between float32 ones) went 1.5x over
    its budget. `clear` forgets every state's."""

    def __init__(self) -> None:
        super().__init__()
        self.mode: AutocastMode = (False, None)
        self._aside: dict[AutocastMode, dict[ShapeKey, PlanChoice]] = {}

    def switch(self, mode: AutocastMode) -> None:
        """Hold the plans of autocast state ``mode`` (set those of the state before aside)."""
        if mode == self.mode:
            return
        self._aside[self.mode] = dict(self)
        super().clear()
        self.update(self._aside.pop(mode, {}))
        self.mode = mode

    def clear(self) -> None:
        super().clear()
        self._aside.clear()

    def to_dicts(self, to_dict: Callable[[PlanChoice], dict[str, Any]]) -> list[dict[str, Any]]:
        """Every autocast state's plans as plain dicts (``to_dict``), each with its state
        (``"autocast"``: None, or the dtype's name): a bf16 plan restored as a float32 one ran
        a resumed float32 fit with the bf16 plans."""
        out = []
        for mode, held in [(self.mode, dict(self)), *self._aside.items()]:
            for choice in {id(c): c for c in held.values()}.values():  # one per choice
                out.append({**to_dict(choice), "autocast": str(mode[1]) if mode[0] else None})
        return out

    def load_dicts(
        self, items: list[dict[str, Any]], from_dict: Callable[[dict[str, Any]], PlanChoice]
    ) -> None:
        """Restore `to_dicts`'s plans, each under its autocast state (one saved without it:
        the state now)."""
        for item in items:
            plain = {k: v for k, v in item.items() if k != "autocast"}
            choice = from_dict(plain)
            name = item.get("autocast", str(self.mode[1]) if self.mode[0] else None)
            mode: AutocastMode = (
                (True, getattr(torch, name.split(".")[-1])) if name else (False, None)
            )
            held = self if mode == self.mode else self._aside.setdefault(mode, {})
            held[(choice.T, choice.batch)] = choice


def refuse_stateless(state_bytes: int) -> None:
    """Refuse a budget for a model that holds no state between steps (``state_bytes`` 0):
    a budget plans checkpoints of that state, and a model without neurons has none (it was
    "state_bytes must be >= 1")."""
    if state_bytes <= 0:
        raise ConfigError(
            "the wrapped model holds no state between time steps (no neuron or recurrent "
            "layer), so a budget has nothing to checkpoint: add its neurons (snn.Leaky(...), "
            "norse.LIFCell()), or call it without a budget (each step then stands alone)"
        )
