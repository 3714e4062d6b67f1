"""Decide how a wrapped model runs: granularity (stack or layer-wise), plan and chunk.

This is the one place those decisions are made; the wrapper, [`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget] and the
command line all ask a planner here. A planner is called at every forward of a
[`CheckpointedSequence`][spikeckpt.wrapping.CheckpointedSequence] with ``decide(model, x, state)`` (``x`` time first)
and returns a [`Decision`][spikeckpt.planning.decide.Decision]; decisions are cached per input shape ``(T, B)``.

- [`Planner`][spikeckpt.planning.decide.Planner] (what [`spikeckpt.wrap`][spikeckpt.wrapping.wrap] installs) follows the model's own ``plan``,
  ``budget``, ``granularity`` and ``chunk``: a given plan runs as given, except that a plan
  built without intervals (``Double()``, ``Uniform()``, ``TwoLevel(s)``) gets them from one
  probe ([`probe_model`][spikeckpt.planning.probe.probe_model]: sizes and step, call and copy times)
  through `spikeckpt.plans.intervals.fill`; ``plan="auto"`` with a budget is chosen by
  [`spikeckpt.scan`][spikeckpt.engine.scan.scan] (`spikeckpt.plans.choose` on the measured sizes and times);
  without a budget, 90% of the free CUDA memory on a GPU, ``Uniform(ceil(sqrt(T)))`` on the
  CPU. With ``granularity="layer"`` and a budget, the chunk is the largest that fits it.
- [`BudgetPlanner`][spikeckpt.planning.decide.BudgetPlanner] (what the Lightning callback installs) plans to a budget with the
  full probe ([`probe_model`][spikeckpt.planning.probe.probe_model]: sizes and measured step, call and
  copy times), agrees across DDP ranks, and remembers its choices in a checkpoint.

Both decide the granularity the same way (`layer_or_stack`): with ``granularity="auto"``
layer-wise runs when the model splits into feed-forward blocks, the readout is not callable,
the input is exactly binary, its modeled device peak fits (the budget, else the stack plan's
own modeled peak) and its modeled time is at most `LAYERWISE_TIME_TOLERANCE` above the
stack plan's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple, NoReturn, Protocol

import torch
from torch import Tensor

from spikeckpt import plans
from spikeckpt.engine.layerwise import LayerBlock, chunk_for
from spikeckpt.engine.packed import input_nbytes, is_packed, step_of
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.planning.probe import (
    Probe,
    Probed,
    block_sizes,
    compute_device,
    layerwise_probe_chunks,
    layerwise_seconds,
    layerwise_working_bytes,
    probe_model,
    scaled_sizes,
    step_work_bytes,
    trainable_bytes,
)
from spikeckpt.plans import Cost, CostModel, Plan, choose
from spikeckpt.plans.choose import minimum_budget
from spikeckpt.plans.intervals import fill, needs_intervals
from spikeckpt.plans.layerwise import (
    BlockSizes,
    LayerwiseCost,
    MeasuredWorking,
    fitting_chunk,
    layerwise_cost,
)
from spikeckpt.storage.codecs import is_binary
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

#: ``granularity="auto"`` accepts a layer-wise modeled time this much above the stack plan's:
#: the model counts ``2T`` step evaluations against e.g. ``Uniform``'s ``2T - k`` (it keeps its
#: last segment taped) but not the layer-wise batched synapse op, which measured faster.
LAYERWISE_TIME_TOLERANCE = 0.05


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

    def layer_blocks(self, required: bool) -> list[LayerBlock] | None:
        """The model's layer-wise blocks; ``None`` when it does not split into them (or
        ``UnsupportedLayerError`` saying why when ``required``)."""
        ...

    def block_states(self, state: Any) -> list[Any]:
        """Each block's part of the model's state."""
        ...


@dataclass(frozen=True)
class StepBytes:
    """What one training step of a wrapped model holds on the device beyond the model
    (parameters, ``.grad`` and optimizer state, which [`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget]
    counts once for all models), as planned, in bytes.

    Attributes:
        input: the input train the step reads while it is on the device (dense bytes, or a
            packed train's packed bytes; 0 when it stays on the host of a GPU run).
        outputs: the stacked per-step outputs and their gradient (``readout=None``).
        gradients: gradient buffers the engine holds beyond ``.grad`` while it accumulates
            the parameters' gradients over segments (stack: a segment's own gradients beside
            the running sum, and one parameter's new sum, made out of place; one copy for
            BPTT; layer-wise: 0, its measured working set holds the running sums, see
            ``activations``).
        activations: the plan's modeled device peak: checkpoints, tapes, states (layer-wise:
            the measured working set of a chunk with the gradient sums, the states, the stored
            trains when they are device memory).
    """

    input: int = 0
    outputs: int = 0
    gradients: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        """All of it: the step's planned peak beyond the model."""
        return self.input + self.outputs + self.gradients + self.activations

    def beside(self) -> str:
        """What the step holds beside its activations, in words (gradient buffers only when
        planned apart: layer-wise measures its gradient sums with its working set)."""
        grads = f", gradient buffers {format_bytes(self.gradients)}" if self.gradients else ""
        return f"input {format_bytes(self.input)}, outputs {format_bytes(self.outputs)}{grads}"


@dataclass(frozen=True)
class PlanChoice:
    """A plan chosen for a budget, and why.

    Attributes:
        plan: the stack plan, intervals filled in for ``T`` (layer-wise: ``Uniform(chunk)``,
            the stack plan with the same step evaluations).
        T: steps planned for.
        batch: batch size planned for.
        budget_bytes: the device budget the plan's activations had to fit (the planner's
            budget less the input, the outputs and the gradient buffers of ``step``).
        probe: the measurements used.
        modeled: the modeled cost (counts, ``peak_bytes``, ``time`` in seconds): a
            [`Cost`][spikeckpt.plans.simulate.Cost], or a [`LayerwiseCost`][spikeckpt.plans.layerwise.LayerwiseCost].
        granularity: ``"stack"`` or ``"layer"``.
        chunk: layer-wise steps per chunk (None for the stack).
        step: what a training step holds beyond the model, as planned (`StepBytes`);
            ``step.total`` is at most the planner's budget.
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
            f"~{self.time_factor:.2f}x BPTT time"
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
        choice: the budget planner's [`PlanChoice`][spikeckpt.planning.decide.PlanChoice] (None for a model's own plan).
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


# ----------------------------------------------------------------------------- granularity


def host_is_device(storage: str, device: torch.device | str) -> bool:
    """Whether the ``storage`` tier is the compute device's own memory: the device tier, and
    the host tier of a CPU run (the host *is* the device there: what it holds counts
    against the budget; only the disk tier is off it)."""
    return storage == "device" or (storage == "host" and torch.device(device).type == "cpu")


class _Layered(NamedTuple):
    """A model's layer-wise blocks, their sizes for planning and the measured working set."""

    blocks: list[LayerBlock]
    sizes: list[BlockSizes]
    working: MeasuredWorking | None = None
    #: measured ``(seconds per step, seconds per chunk)`` of the training step's run
    seconds: tuple[float, float] | None = None


def _layerwise_candidate(
    model: Planned,
    x: Any,
    state: Any,
    required: bool,
    *,
    budgeted: bool = True,
    max_bytes: int | None = None,
) -> _Layered | None:
    """The blocks and their sizes when layer-wise can run, else None.

    ``budgeted=False``: the sizes [`block_sizes`][spikeckpt.planning.probe.block_sizes] measures (what a model's own
    [`Planner`][spikeckpt.planning.decide.Planner] compares with the stack plan). ``budgeted=True`` (the
    [`BudgetPlanner`][spikeckpt.planning.decide.BudgetPlanner]'s): made safe for a budget: stored spike trains are counted at
    the bit-pack size whatever their density now (the ``auto`` codec never stores more; the
    density of hidden spikes grows as the model trains, and index lists with it), dense with
    the device tier (it stores them unpacked); ``working`` is the training step's working set
    as `layerwise_working_bytes` measures it (held under
    ``max_bytes``; the parameters' gradient sums included).
    """
    blocks = model.layer_blocks(required)
    if blocks is None:
        return None
    device = compute_device(model, x)
    fuse = bool(getattr(model, "fuse", True))
    sizes = block_sizes(blocks, step_of(x, 0, device), model.block_states(state), fuse)
    if not budgeted:
        return _Layered(blocks, sizes)
    unpacked = model.storage == "device"
    sizes = [replace(b, density=None if unpacked or b.density is None else 1.0) for b in sizes]
    working = layerwise_working_bytes(
        blocks,
        x,
        lambda x_t: model.block_states(model.initial_state(x_t)),
        sizes,
        device=device,
        storage=model.storage,
        readout=model.readout,
        output=model.output,
        stored_on_device=host_is_device(model.storage, device),
        fuse=fuse,
        max_bytes=max_bytes,
    )
    allowed = layerwise_probe_chunks(int(x.shape[0]), sizes, max_bytes)  # held like the probe
    seconds = layerwise_seconds(
        blocks,
        x,
        lambda x_t: model.block_states(model.initial_state(x_t)),
        device=device,
        storage=model.storage,
        readout=model.readout,
        output=model.output,
        fuse=fuse,
        chunks=(allowed[0], allowed[-1]),
    )
    return _Layered(blocks, sizes, working, seconds)


def _layerwise_may_pay(model: Planned, x: Any) -> bool:
    """``granularity="auto"`` considers layer-wise only for named readouts and binary inputs
    (its stored trains are packed to 1 bit per element only when they are spikes)."""
    return not callable(model.readout) and (is_packed(x) or is_binary(x))


def _chunk_candidates(T: int, preferred: int) -> list[int]:
    """Chunk lengths to try, ``1..min(preferred, T)``: all of them up to 4096, else a
    geometric grid of about 2000."""
    top = max(1, min(preferred, T))
    if top <= 4096:
        return list(range(1, top + 1))
    return sorted({max(1, min(top, round(top ** (i / 2000)))) for i in range(2001)})


def _fitting_chunk(
    T: int,
    sizes: Sequence[BlockSizes],
    limit: int,
    preferred: int,
    *,
    remote: bool,
    working: MeasuredWorking | None = None,
) -> int | None:
    """The largest chunk ``<= preferred`` whose modeled layer-wise peak fits ``limit``, or
    None. With the trains and chunk states off the device the peak grows with the chunk
    ([`fitting_chunk`][spikeckpt.plans.layerwise.fitting_chunk] bisects); on the device the stored
    chunk states shrink as the chunk grows, so the peak is not monotonic: chunks are tried
    from the longest down."""
    if remote:
        return fitting_chunk(T, sizes, limit, preferred, remote=True, working=working)
    for k in reversed(_chunk_candidates(T, preferred)):
        if layerwise_cost(T, k, sizes, remote=False, working=working).peak_bytes <= limit:
            return k
    return None


def _smallest_layerwise(
    T: int, sizes: Sequence[BlockSizes], *, remote: bool, working: MeasuredWorking | None = None
) -> int:
    """The least modeled layer-wise peak over all chunk lengths."""
    if remote:
        return layerwise_cost(T, 1, sizes, remote=True, working=working).peak_bytes
    return min(
        layerwise_cost(T, k, sizes, remote=False, working=working).peak_bytes
        for k in _chunk_candidates(T, T)
    )


def _smallest_probed_layerwise(
    T: int,
    sizes: Sequence[BlockSizes],
    working: MeasuredWorking,
    *,
    remote: bool,
    beside: int,
    unprobed: int,
) -> int:
    """The least layer-wise peak that a probe held under it would find enough.

    ``working`` was measured at every chunk length; a probe held under a budget measures the
    shorter ones only (`layerwise_probe_chunks`), and fewer
    lengths can model more at some chunks. ``beside``: the step's other bytes (input,
    outputs); ``unprobed``: what the probe may not use (the input on the device). Raised
    until the lengths that fit the named budget model no more than it (the lengths only
    grow, so this ends)."""
    need = _smallest_layerwise(T, sizes, remote=remote, working=working)
    while True:
        room = max(beside + need - unprobed, 0)
        probed = working.prefix(len(layerwise_probe_chunks(T, sizes, room)))
        again = _smallest_layerwise(T, sizes, remote=remote, working=probed)
        if again <= need:
            return need
        need = again


def layer_or_stack(
    T: int,
    sizes: Sequence[BlockSizes],
    plan: Any,
    *,
    limit: int | None,
    remote: bool,
    chunk: int | None,
    costs: CostModel | None = None,
) -> int | None:
    """Layer-wise or stack for ``T`` steps of blocks of ``sizes``: the layer-wise chunk, or
    None when the stack plan wins.

    ``plan``: the stack plan (or ``"auto"``: chosen here for ``limit``); ``limit``: the device
    budget (None: the stack plan's own modeled peak); ``chunk``: a fixed chunk (None: the
    plan's interval, else ``ceil(sqrt(T))``, shrunk to the largest that fits ``limit``).
    """
    S = sum(b.state_bytes for b in sizes)
    A = max(1, sum(b.step_bytes for b in sizes))
    k = chunk if chunk is not None else chunk_for(plan, T)
    if limit is not None and chunk is None:
        k = _fitting_chunk(T, sizes, limit, k, remote=remote) or k
    layer = layerwise_cost(T, k, sizes, remote=remote, costs=costs)
    if isinstance(plan, str):  # "auto" with a budget
        try:
            plan = choose(T, S, A, limit if limit is not None else 0, remote=remote, costs=costs)
        except plans.BudgetTooSmall:
            fits = limit is not None and layer.peak_bytes <= limit
            return layer.chunk if fits else None
    if not isinstance(plan, Plan):  # a hand-written schedule: run it as written
        return None
    stack = plan.cost(T, state_bytes=S, step_bytes=A, costs=costs)
    fits = layer.peak_bytes <= (limit if limit is not None else stack.peak_bytes)
    close_in_time = layer.time <= stack.time * (1 + LAYERWISE_TIME_TOLERANCE)
    return layer.chunk if fits and close_in_time else None


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
        decisions: shape ``(T, B)`` -> the [`Decision`][spikeckpt.planning.decide.Decision] for ``granularity="auto"``.
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
            found = _layerwise_candidate(model, x, state, required=True)
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
        """The [`Decision`][spikeckpt.planning.decide.Decision] for input ``x`` ``(T, B, ...)`` (a tensor or a packed train)
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
        if not _layerwise_may_pay(model, x):
            return Decision("stack", plan, budget=budget)
        key = (T, int(x.shape[1]))
        if key not in self.decisions:
            self.decisions[key] = self._auto(model, x, state, plan, budget)
        return self.decisions[key]

    def _within_budget(self, model: Planned, x: Any, state: Any, budget: int) -> Decision:
        """``plan="auto"`` with a budget: the step model [`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget] plans with
        ([`BudgetPlanner`][spikeckpt.planning.decide.BudgetPlanner]: input on the device, outputs, gradient buffers, activations),
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
        found = _layerwise_candidate(model, x, state, False, budgeted=False)
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


class BudgetPlanner:
    """Choose and cache a plan per input shape so a wrapped model fits ``budget`` bytes.

    The first time it sees an input shape it probes the model
    ([`probe_model`][spikeckpt.planning.probe.probe_model], held under the budget; for a model wrapped
    with ``granularity="layer"`` or ``"auto"`` also the layer-wise working set,
    `layerwise_working_bytes`), models what a training step
    holds (`StepBytes`: the input train while it is on the device, the stacked
    outputs and their gradient, the engine's gradient buffers, the plan's activations),
    picks the plan with the least modeled time whose step fits with
    `spikeckpt.plans.choose` (layer-wise: the largest chunk that fits), and caches it
    for that shape. When the storage tier is the device's own memory (the device tier; the
    host tier on a CPU run), stored checkpoints and trains count as activations and no plan
    with off-device checkpoints is chosen.

    Across processes (DDP) the planner agrees with the other ranks through two functions set by
    the caller: ``reduce_max`` (the planned ``T`` and batch are the largest over the ranks) and
    ``broadcast`` (rank 0's measurements are used), so every rank chooses the same plan.

    Args:
        budget: device bytes (int or a string like ``"2GiB"``) for what this model's step
            holds beyond the model itself (`StepBytes`).
        remote: allow plans with off-device checkpoints (needs ``storage`` host or disk).
        costs: fixed operation times; None measures them with the probe.

    Attributes:
        choices: shape ``(T, B)`` -> [`PlanChoice`][spikeckpt.planning.decide.PlanChoice].
        probes: how many probes ran (a resumed run with known shapes runs none).
        reduce_max: set by a distributed caller: ``int -> int`` max over ranks.
        broadcast: set by a distributed caller: ``obj -> rank 0's obj``.
        last: the latest [`PlanChoice`][spikeckpt.planning.decide.PlanChoice].
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
        """The [`Decision`][spikeckpt.planning.decide.Decision] for input ``x`` ``(T, B, ...)`` (time first) from ``state``."""
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
        """Probe the model and choose, so that the step's planned peak (`StepBytes`:
        input, outputs, gradient buffers, activations) fits `budget_bytes`."""
        device = compute_device(model, x)
        on_device = host_is_device(model.storage, device)
        remote = self.remote and not on_device
        x_bytes = input_nbytes(x) if x.device == device else 0
        params = [p for p in model.parameters_for_scan() if p.requires_grad]
        grads = trainable_bytes(params)
        largest_param = max((p.numel() * p.element_size() for p in params), default=0)
        room = max(self.budget_bytes - x_bytes, 0)  # what the probes may hold at once
        probe = probe_model(model, x, state, model.storage, max_bytes=room)
        layered = None
        if model.granularity == "layer" or (
            model.granularity == "auto" and _layerwise_may_pay(model, x)
        ):
            layered = _layerwise_candidate(
                model, x, state, model.granularity == "layer", max_bytes=room
            )
        self.probes += 1
        sizes = layered.sizes if layered is not None else None
        # layer-wise: the measured working set holds the running sums of the gradients
        working = layered.working if layered is not None else None
        seconds = layered.seconds if layered is not None else None
        if self.broadcast is not None:
            probe, sizes, working = self.broadcast((probe, sizes, working))
        if sizes is not None:
            sizes = [scaled_sizes(b, batch, probe.batch) for b in sizes]
        if working is not None:
            working = working.scaled(batch, probe.batch)
        probe = probe.scaled(batch)
        costs = self.costs or probe.costs()
        outputs = 2 * T * probe.output_bytes if model.readout is None else 0
        base = StepBytes(input=x_bytes, outputs=outputs)
        S, A, work = probe.state_bytes, probe.step_bytes, probe.work_bytes
        preferred = model.chunk if model.chunk is not None else T
        # the stack: its plan's peak, one step's working memory, and while the engine sums
        # the parameters' gradients over segments, a segment's own gradients beside the
        # running sum, and one parameter's new sum when it is made out of place
        stack_step = replace(base, gradients=grads + largest_param)
        stack_budget = self.budget_bytes - stack_step.total
        stack: PlanChoice | None = None
        if model.granularity != "layer":
            try:
                plan = choose(T, S, A, max(stack_budget - work, 0), remote=remote, costs=costs)
            except plans.BudgetTooSmall:
                pass
            else:
                plan = plan.for_length(T)
                modeled = plan.cost(T, state_bytes=S, step_bytes=A, costs=costs)
                activations = replace(stack_step, activations=modeled.peak_bytes + work)
                if isinstance(plan, plans.BPTT):  # one backward call: no running sum
                    activations = replace(activations, gradients=grads)
                stack = PlanChoice(plan, T, batch, stack_budget, probe, modeled, step=activations)
        # layer-wise: the largest chunk whose modeled (calibrated) peak fits
        layer: PlanChoice | None = None
        layer_budget = self.budget_bytes - base.total
        if sizes is not None:
            chunk = _fitting_chunk(
                T, sizes, layer_budget, preferred, remote=not on_device, working=working
            )
            if chunk is not None:
                layer = self._layer_choice(
                    T,
                    batch,
                    layer_budget,
                    probe,
                    sizes,
                    chunk,
                    on_device,
                    costs,
                    base,
                    working,
                    seconds,
                )
        if layer is not None and (
            stack is None
            or layer.modeled.time <= stack.modeled.time * (1 + LAYERWISE_TIME_TOLERANCE)
        ):
            return layer
        if stack is not None:
            return stack
        # Nothing fits: name the smallest budget that does. The probes were held under this
        # budget; the minimum is measured without the cap, so that passed back, the capped
        # probes of that run find a plan that fits (the stack's measure only grows with room;
        # layer-wise, the lengths a probe held under the named budget measures are checked).
        needs = []
        if model.granularity != "layer":
            if probe.work_capped:
                local = int(x.shape[1])  # this rank's batch; A is planned for ``batch``
                a_local = -(-A * local // batch)
                work = -(-step_work_bytes(model, x, state, a_local) * batch // local)
            needs.append((stack_step, minimum_budget(T, S, A) + work))
        if sizes is not None:
            full = _layerwise_candidate(model, x, state, True)
            assert full is not None and full.working is not None  # the capped probe ran
            local = int(x.shape[1])
            smallest = _smallest_probed_layerwise(
                T,
                [scaled_sizes(b, batch, local) for b in full.sizes],
                full.working.scaled(batch, local),
                remote=not on_device,
                beside=base.total,
                unprobed=x_bytes,
            )
            needs.append((base, smallest))
        step, smallest = min(needs, key=lambda need: need[0].total + need[1])
        what = "layer-wise, " if model.granularity == "layer" else ""
        self._refuse(f"{what}T={T}, B={batch}", step, smallest)

    def _refuse(self, what: str, step: StepBytes, smallest: int) -> NoReturn:
        """Raise [`BudgetTooSmall`][spikeckpt.errors.BudgetTooSmall] naming a budget that works when passed
        back: the step's input, outputs and gradient buffers plus the smallest plan's
        activations, as the caller counts budgets (`total_for`)."""
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

    @staticmethod
    def _layer_choice(
        T: int,
        batch: int,
        budget: int,
        probe: Probe,
        sizes: Sequence[BlockSizes],
        chunk: int,
        on_device: bool,
        costs: CostModel,
        step: StepBytes,
        working: MeasuredWorking | None,
        seconds: tuple[float, float] | None = None,
    ) -> PlanChoice:
        modeled = layerwise_cost(
            T, chunk, sizes, remote=not on_device, costs=costs, working=working, seconds=seconds
        )
        plan = plans.Uniform(modeled.chunk).for_length(T)
        return PlanChoice(
            plan,
            T,
            batch,
            budget,
            probe,
            modeled,
            "layer",
            modeled.chunk,
            replace(step, activations=modeled.peak_bytes),
        )

    def state_dict(self) -> dict[str, Any]:
        """Budget and chosen plans per shape, as plain dicts, lists and numbers (loadable with
        ``torch.load(weights_only=True)``, as Lightning loads checkpoints)."""
        return {
            "budget_bytes": self.budget_bytes,
            "choices": [_choice_to_dict(choice) for choice in self.choices.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the chosen plans; they are kept only if the budget is the same."""
        if state.get("budget_bytes") != self.budget_bytes:
            return
        for item in state.get("choices", []):
            choice = _choice_from_dict(item)
            self.choices[(choice.T, choice.batch)] = choice


def _choice_to_dict(choice: PlanChoice) -> dict[str, Any]:
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
    }


def _choice_from_dict(item: dict[str, Any]) -> PlanChoice:
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
    )
