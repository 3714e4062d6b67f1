"""One account of a training step's device memory, and the one choice made from it. Pure Python.

``budget`` means the same wherever it is accepted ([`scan`][spikeckpt.engine.scan.scan],
[`wrap`][spikeckpt.wrapping.wrap], [`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget], ``spikeckpt plan``, the
benchmarks): the peak device memory of the training step the call runs. What a step holds
([`StepBytes`][spikeckpt.plans.account.StepBytes]):

- ``input``: the input train while it is on the device (a packed train's packed bytes);
- ``outputs``: the stacked per-step outputs and their gradient (``readout=None``), or a
  tensor of the readout's size that the loss makes of it, and the loss and its gradient (two
  scalars);
- ``gradients``: under a checkpointing plan the parameters' ``.grad`` (left to the model's
  account by ``MemoryBudget``, which counts the model, ``.grad`` and the optimizer state once
  for all wrapped models) and the gradient buffers the engine holds beyond it while it sums the
  parameters' gradients over segments (a segment's own gradients beside the running sum, one
  parameter's new sum, and the state's gradient carried from segment to segment); under
  ``BPTT()`` autograd's sums over the steps, which become ``.grad``, beside one parameter's new
  gradient and its sum (no ``.grad`` beside them: they become it); layer-wise no more than
  its measured working set, which holds the running sums that become ``.grad``; and, in
  every case, a ``.grad`` held from before the step (gradients accumulating), beside the
  step's own sums;
- ``activations``: the plan's modeled peak (checkpoints kept on the device, or on the host when
  the host is the device as on a CPU-only run, tapes, states) and one step's working memory.

[`choose_step`][spikeckpt.plans.account.choose_step] picks the fastest plan whose step fits a budget (and [`check_step`][spikeckpt.plans.account.check_step]
checks a plan given with a budget); both refuse with one
[`BudgetTooSmall`][spikeckpt.errors.BudgetTooSmall] whose ``minimum_bytes``, passed back as the budget, works.

>>> sizes = StepSizes(state=1024, tape=1024, grads=4096, largest=4096, work=2048)
>>> choice = choose_step(1000, sizes, 96 * 1024, remote=False)
>>> choice.plan, choice.step.total <= 96 * 1024
(Uniform(interval=59), True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from spikeckpt.errors import BudgetTooSmall, ConfigError
from spikeckpt.plans.base import Plan
from spikeckpt.plans.bptt import BPTT
from spikeckpt.plans.choose import minimum_budget, rank
from spikeckpt.plans.schedule import Schedule
from spikeckpt.plans.simulate import Cost, CostModel, simulate
from spikeckpt.units import format_bytes, parse_bytes

__all__ = [
    "StepBytes",
    "StepChoice",
    "StepSizes",
    "check_step",
    "choose_step",
    "host_is_device",
    "rank_steps",
    "budget_within",
    "refusal",
    "slow_note",
    "step_bytes",
    "tier_note",
]


#: the loss a training step reduces its outputs to, and the loss's gradient: two scalars of
#: up to 8 bytes (a sweep's first calls at the named smallest budget held 8 bytes over it,
#: their float32 loss and its gradient; with a readout of ``(16, 32)``, 1,848 bytes over:
#: the loss's own product of the readout's size, now counted in `StepSizes.outputs`)
LOSS_BYTES = 16

#: A stack plan modeled slower than this many times BPTT's time (`Cost.time_factor`) is
#: slow: a refusal whose smallest budget runs one, and a call that chooses one, also name the
#: budget that runs within `QUICK_FACTOR` (at the smallest budget the stack runs
#: ``Revolve(slots=1)``, which recomputes about ``T/2`` steps per step: T = 600 took 167 s
#: where 1.25x that budget took 2.4 s)
SLOW_FACTOR = 3.0
#: The modeled time (times BPTT's) of the budget named for a slow plan: below `SLOW_FACTOR`
#: by a margin, since a call's probe measures the operation times anew (a budget named for
#: 3x ran a plan modeled at 4x in the call given it)
QUICK_FACTOR = 2.0


@dataclass(frozen=True)
class StepSizes:
    """What one step of a model measures, for the account (bytes, at one batch size).

    Attributes:
        state: ``S``, bytes of one state.
        tape: ``A``, bytes autograd keeps for one taped step (at least 1).
        work: one step's working memory beyond the plan's states and tapes (its new state,
            output and temporaries; a taped step's backward beyond its tape).
        output: one step's output ``y_t``.
        input: the whole input train while it is on the device (0 when it stays off it).
        stacked: the outputs are stacked ``(T, ...)`` (``readout=None``), with their gradient.
        grads: bytes of the parameters that require grad (one ``.grad`` each).
        largest: the largest such parameter (its new sum is made out of place).
        grad_in_step: ``.grad`` is counted in the step (``scan``, ``wrap``), or with the
            model (``MemoryBudget``); ``BPTT()``'s gradients are counted alike either way.
        grads_held: ``.grad`` is held when the step begins (gradients accumulating over
            steps): the step's own sums are added into it, and both are held (measured: a
            ``Revolve(1)`` step of a 100-256-10 net held 113,704 bytes more, its ``.grad``).
        casts: autocast's cached casts of the parameters (`cached_cast_bytes`): held beside
            the forward, and made again by each recomputed segment, beside its backward.
    """

    state: int
    tape: int
    work: int = 0
    output: int = 0
    input: int = 0
    stacked: bool = False
    grads: int = 0
    largest: int = 0
    grad_in_step: bool = True
    grads_held: bool = False
    casts: int = 0

    def __post_init__(self) -> None:
        for name in ("state", "tape", "work", "output", "input", "grads", "largest", "casts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"StepSizes.{name} must be a whole number of bytes >= 0")
        if self.tape < 1:
            object.__setattr__(self, "tape", 1)

    def outputs(self, T: int) -> int:
        """The stacked outputs and their gradient over ``T`` steps; with a readout, one
        tensor of the output's size that the loss makes of it (cross-entropy's log-softmax of
        ``(B, classes)`` counts); and the scalar loss and its gradient (`LOSS_BYTES`). A
        step of no measured output (a plan on paper: ``spikeckpt plan``) counts none."""
        if not self.output:
            return 0
        return (2 * T * self.output if self.stacked else self.output) + LOSS_BYTES

    @property
    def held_grads(self) -> int:
        """``.grad`` held from before the step, beside the step's own sums (bytes)."""
        return self.grads if self.grad_in_step and self.grads_held else 0

    def beside(self, T: int, *, bptt: bool = False) -> StepBytes:
        """The step without its activations: the input, the outputs, the gradients."""
        if bptt:
            # one backward call: autograd sums each parameter's gradient over the steps in its
            # own buffer, which becomes ``.grad`` (taken over when ``.grad`` is None, added in
            # place when held from before the step); beside the buffers, one parameter's new
            # gradient and its sum made out of place (a Linear's weight gradient arrives as a
            # view, which autograd sums out of place: 3.0x the weight of a Linear(2048, 2048)
            # + Leaky net, 2026-11-27). The engine now hands each first contribution on as a
            # plain tensor (`spikeckpt.engine.sums`: 2.0x measured, 2026-11-29); the out-of-place
            # sum stays counted for a first use it does not find and for dispatch modes (the
            # "tensors" meter), under which autograd never sums in place
            return StepBytes(
                input=self.input,
                outputs=self.outputs(T),
                gradients=self.grads + 2 * self.largest + self.held_grads + self.casts,
            )
        grad = self.grads + self.held_grads if self.grad_in_step else 0
        # a checkpointed backward holds a segment's own gradients beside the running sum, one
        # parameter's new sum (made out of place) and the state's gradient carried between
        # segments (measured: one state over the rest with Revolve(1) on a conv net)
        buffers = self.grads + self.largest + self.state + self.casts
        return StepBytes(input=self.input, outputs=self.outputs(T), gradients=grad + buffers)


@dataclass(frozen=True)
class StepBytes:
    """What one training step holds on the device, as planned, in bytes (see the module).

    Attributes:
        input: the input train while it is on the device.
        outputs: the stacked outputs and their gradient.
        gradients: ``.grad`` (unless the model's account holds it) and the engine's gradient
            buffers (layer-wise: 0, its measured working set holds the running sums).
        activations: the plan's modeled peak and one step's working memory.
    """

    input: int = 0
    outputs: int = 0
    gradients: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        """All of it: the step's planned device peak."""
        return self.input + self.outputs + self.gradients + self.activations

    def beside(self) -> str:
        """What the step holds beside its activations, in words (gradients only when
        planned apart: layer-wise measures its gradient sums with its working set)."""
        grads = f", gradients {format_bytes(self.gradients)}" if self.gradients else ""
        return f"input {format_bytes(self.input)}, outputs {format_bytes(self.outputs)}{grads}"


@dataclass(frozen=True)
class StepChoice:
    """A stack plan for a budget: the plan (intervals filled for ``T``; or a ``Schedule``
    given as it is), its modeled cost and the step it makes (``step.total`` at most the
    budget)."""

    plan: Plan | Schedule
    cost: Cost
    step: StepBytes


def host_is_device(storage: str, device_type: str) -> bool:
    """Whether the ``storage`` tier is the compute device's own memory: the device tier, and
    the host tier of a CPU run (the host *is* the device there; only the disk is off it)."""
    return storage == "device" or (storage == "host" and device_type == "cpu")


def grads_note(grads: int, held: bool) -> str:
    """A refusal's words on ``.grad`` (``grads`` bytes) where the step counts it: held from an
    earlier call (counted beside the step's own sums), or what holding it would add."""
    size = format_bytes(grads)
    if held:
        return (
            "`.grad` is held from an earlier call (gradients accumulating; "
            f"`optimizer.zero_grad()` frees it): its {size} count beside the step's own"
        )
    return f"a call that begins with `.grad` held (accumulating) needs {size} more"


def join_notes(*notes: str | None) -> str | None:
    """The notes given, joined with ``"; "`` (None when there are none)."""
    given = [note for note in notes if note]
    return "; ".join(given) if given else None


def tier_note(storage: str, device_type: str) -> str | None:
    """On a CPU run, which memory the ``storage`` tier is, in words (None on a GPU)."""
    if device_type != "cpu":
        return None
    if storage == "host":
        return (
            "CPU run: the host tier is this device's memory, so checkpoints kept there count "
            "against the budget (storage='disk' keeps them off it)"
        )
    if storage == "disk":
        return "CPU run: the remote tier is the disk: remote checkpoints are off the budget"
    return "CPU run: storage='device' keeps every checkpoint in the budget"


def step_bytes(
    T: int, sizes: StepSizes, plan: Plan | Schedule, cost: Cost, *, remote_on_device: bool
) -> StepBytes:
    """The step ``plan`` makes: its modeled ``cost`` (states and tapes on the device; with
    ``remote_on_device`` its remote checkpoints too) and one step's working memory beside
    the input, outputs and gradients."""
    peak = cost.peak_bytes + (cost.peak_remote_states * sizes.state if remote_on_device else 0)
    beside = sizes.beside(T, bptt=isinstance(plan, BPTT))
    return replace(beside, activations=peak + sizes.work)


def _steps(T: int, apart: int) -> str:
    if not apart:
        return f"T={T} steps"
    return f"T={T + apart} steps (step 0 runs apart, taped; the checkpointed run has {T})"


def refusal(
    budget: int,
    need: StepBytes,
    smallest: int,
    *,
    what: str,
    asked: int | None = None,
    minimum: int | None = None,
    note: str | None = None,
    context: str = "",
    plan: Plan | Schedule | None = None,
    after: str | None = None,
) -> BudgetTooSmall:
    """The one [`BudgetTooSmall`][spikeckpt.errors.BudgetTooSmall]: the step ``need`` (input, outputs,
    gradients) and the ``smallest`` activations of any plan (of ``plan``, when the caller
    gave one) do not fit ``budget``.

    ``asked``: the budget as the caller counts it (default ``budget``); ``minimum``: the
    budget that works, as the caller counts it (default ``need.total + smallest``); ``what``
    names the run (``"T=300, B=8"``); ``note`` and ``context`` are added to the account;
    ``after`` follows the budget named (`slow_note`'s)."""
    total = need.total + smallest
    asked = budget if asked is None else asked
    minimum = total if minimum is None else minimum
    if plan is not None:
        name = f"the schedule {plan.plan}" if isinstance(plan, Schedule) else repr(plan)
        head = f"{name} cannot keep the budget of {format_bytes(asked)}"
        tail = f"a budget that keeps {name} is"
    elif budget <= need.total:
        head = f"the budget of {format_bytes(asked)} leaves nothing for activations"
        tail = "the smallest budget that fits is"
    else:
        head = f"no checkpointing plan fits the budget of {format_bytes(asked)}"
        tail = "the smallest budget that fits is"
    extra = f"; {note}" if note else ""
    kind = "its plan" if plan is not None else "smallest plan"
    return BudgetTooSmall(
        f"{head} for {what}: a step needs {format_bytes(total)} ({need.beside()}, {kind} "
        f"{format_bytes(smallest)}){context}{extra}; {tail} {minimum} bytes "
        f"({format_bytes(minimum)}){f', {after}' if after else ''}",
        budget_bytes=asked,
        minimum_bytes=minimum,
    )


def choose_step(
    T: int,
    sizes: StepSizes,
    budget: int | str,
    *,
    remote: bool,
    costs: CostModel | None = None,
    apart: int = 0,
    note: str | None = None,
) -> StepChoice:
    """The plan with the least modeled time whose training step fits ``budget``.

    Args:
        T: steps the plan runs.
        sizes: what one step measures ([`StepSizes`][spikeckpt.plans.account.StepSizes]).
        budget: the step's device budget (bytes or a string like ``"2MiB"``).
        remote: plans with off-device checkpoints may be chosen (the remote tier is not the
            device's memory: not the device tier, not the host of a CPU run).
        costs: operation times for the modeled time (default [`CostModel`][spikeckpt.plans.simulate.CostModel]).
        apart: steps run before these ``T`` (step 0 of a state it shapes), for messages.
        note: added to a refusal (e.g. [`tier_note`][spikeckpt.plans.account.tier_note]).

    Raises:
        BudgetTooSmall: nothing fits; ``minimum_bytes`` is a budget that does.
    """
    total = parse_bytes(budget)
    ranked = rank_steps(T, sizes, total, remote=remote, costs=costs)
    if ranked:
        return ranked[0]
    beside = sizes.beside(T)
    smallest = minimum_budget(T, sizes.state, sizes.tape) + sizes.work
    slow = slow_note(T, sizes, beside.total + smallest, remote=remote, costs=costs)
    after = f"where {slow}" if slow else None
    raise refusal(total, beside, smallest, what=_steps(T, apart), note=note, after=after)


def rank_steps(
    T: int,
    sizes: StepSizes,
    budget: int | str,
    *,
    remote: bool,
    costs: CostModel | None = None,
) -> list[StepChoice]:
    """Every plan family's best member whose step fits ``budget``, fastest first (the first
    is [`choose_step`][spikeckpt.plans.account.choose_step]'s choice; empty when nothing fits).
    BPTT's step counts its gradients apart (`StepSizes.beside`): it may fit a budget whose
    room the others' gradient buffers leave too small for its tapes, and the reverse."""
    total = parse_bytes(budget)
    room = total - sizes.beside(T).total - sizes.work
    bptt = BPTT().cost(T, state_bytes=sizes.state, step_bytes=sizes.tape, costs=costs)
    quickest = StepChoice(BPTT(), bptt, step_bytes(T, sizes, BPTT(), bptt, remote_on_device=False))
    found = [quickest] if quickest.step.total <= total else []  # its gradients count apart
    if room < 0:
        return found
    for candidate in rank(T, sizes.state, sizes.tape, room, remote=remote, costs=costs):
        plan = candidate.plan.for_length(T)
        if isinstance(plan, BPTT):
            continue  # counted above, by its own step
        cost = plan.cost(T, state_bytes=sizes.state, step_bytes=sizes.tape, costs=costs)
        step = step_bytes(T, sizes, plan, cost, remote_on_device=False)
        if step.total <= total:
            found.append(StepChoice(plan, cost, step))
    return found


def check_step(
    T: int,
    sizes: StepSizes,
    plan: Plan | Schedule,
    budget: int | str,
    *,
    remote_on_device: bool,
    costs: CostModel | None = None,
    apart: int = 0,
    note: str | None = None,
) -> StepChoice:
    """``plan`` (intervals filled for ``T``) with the step it makes, refused when that step
    does not fit ``budget``: a budget given with an explicit plan is a promise too.

    ``remote_on_device``: the plan's remote checkpoints are in the device's memory (the
    device tier; the host tier of a CPU run) and count.

    Raises:
        BudgetTooSmall: the plan's step is over the budget; ``minimum_bytes`` is its total
            (the budget that keeps this plan).
    """
    total = parse_bytes(budget)
    S, A = sizes.state, sizes.tape
    if isinstance(plan, Schedule):
        cost = simulate(plan, state_bytes=S, step_bytes=A, costs=costs)
    else:
        plan = plan.for_length(T)
        cost = plan.cost(T, state_bytes=S, step_bytes=A, costs=costs)
    step = step_bytes(T, sizes, plan, cost, remote_on_device=remote_on_device)
    if step.total > total:
        beside = replace(step, activations=0)
        raise refusal(total, beside, step.activations, what=_steps(T, apart), note=note, plan=plan)
    return StepChoice(plan, cost, step)


def budget_within(
    T: int,
    sizes: StepSizes,
    *,
    remote: bool,
    costs: CostModel | None = None,
    factor: float = QUICK_FACTOR,
) -> int:
    """The smallest step budget (bytes, to 1%) whose [`choose_step`][spikeckpt.plans.account.choose_step]
    plan is modeled within ``factor`` times BPTT's time: more room never chooses a slower
    plan, so a bisection between the smallest budget that fits and BPTT's own step finds it."""
    costs = costs or CostModel()
    bptt = BPTT().cost(T, state_bytes=sizes.state, step_bytes=sizes.tape, costs=costs)
    high = step_bytes(T, sizes, BPTT(), bptt, remote_on_device=False).total  # chooses BPTT
    low = sizes.beside(T).total + minimum_budget(T, sizes.state, sizes.tape) + sizes.work

    def within(total: int) -> bool:
        try:
            found = choose_step(T, sizes, total, remote=remote, costs=costs)
        except BudgetTooSmall:
            return False
        return found.cost.time_factor(costs) <= factor

    if within(low):
        return low
    while high - low > max(low // 100, 1) and low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if within(middle) else (middle, high)
    return high


def slow_note(
    T: int,
    sizes: StepSizes,
    total: int,
    *,
    remote: bool,
    costs: CostModel | None = None,
    named: Callable[[int], int] | None = None,
) -> str | None:
    """Where the stack plan a step budget of ``total`` bytes chooses is modeled slower than
    `SLOW_FACTOR` times BPTT's time: the plan, its factor and the budget that runs within
    `QUICK_FACTOR` (`budget_within`; ``named`` turns it into the budget as the caller counts
    it); None where it is not slow (or nothing fits ``total``)."""
    costs = costs or CostModel()
    try:
        found = choose_step(T, sizes, total, remote=remote, costs=costs)
    except BudgetTooSmall:
        return None
    slow = found.cost.time_factor(costs)
    if slow <= SLOW_FACTOR:
        return None
    within = budget_within(T, sizes, remote=remote, costs=costs)
    within = named(within) if named is not None else within
    return (
        f"{found.plan!r} runs, modeled at {slow:.0f}x BPTT's time (it recomputes "
        f"steps over and over); {within} bytes ({format_bytes(within)}) runs within "
        f"{QUICK_FACTOR:g}x"
    )
