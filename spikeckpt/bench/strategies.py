"""Training-step strategies compared by ``spikeckpt bench``, on one LIF workload.

Every strategy is a function that runs **one training step** (forward over ``T`` steps, loss,
backward into the parameters' ``.grad``) of a [`LIFStack`][spikeckpt.models.LIFStack] on a spike
train. They differ only in how the time loop keeps what the backward pass needs:

- ``bptt``: the plain loop; autograd keeps every step's tape.
- ``checkpoint``: ``torch.utils.checkpoint`` around each ``ceil(sqrt(T))``-step segment
  (``use_reentrant=False``), what users write today (Chen et al.'s sqrt(T) scheme).
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu``: the tape is copied to host memory.
  On a CPU-only machine the host *is* the device: nothing moves and nothing is saved.
- ``uniform-sqrt``: ``scan`` with ``Uniform(ceil(sqrt(T)))`` (Chen et al. through spikeckpt).
- ``uniform``, ``revolve``, ``double-host``, ``double-disk``, ``twolevel``: ``scan`` with the
  fastest plan of that family whose modeled device peak fits the plan budget
  ([`spikeckpt.plans.rank`][spikeckpt.plans.choose.rank] with measured operation costs).
- ``twolevel-async``: Kukreja et al.'s asynchronous multistage scheme, a disk checkpoint every
  ``ceil(write / forward)`` steps and Revolve(4) in between.
- ``layerwise``: not available yet (listed, never faked).

The loss is ``mean((rate - 0.1)^2)`` of the output layer's firing rate over time, a readout
reduced inside the loop (no ``(T, B, N)`` output tensor, which no checkpointing can remove).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from spikeckpt import plans
from spikeckpt.bench import STRATEGY_NAMES
from spikeckpt.errors import ConfigError
from spikeckpt.models import LIFStack, spike_train
from spikeckpt.plans.account import step_bytes

__all__ = [
    "STRATEGIES",
    "Context",
    "Outcome",
    "Strategy",
    "Workload",
    "available",
    "parse_strategies",
    "pick_plan",
]

State = tuple[tuple[Tensor, Tensor], ...]


# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """The benchmark network and its input.

    Attributes:
        batch: samples per step.
        inputs: input channels (Bernoulli spikes).
        hidden: width of each hidden LIF layer.
        layers: number of hidden LIF layers (the last one is the output layer).
        density: probability of an input spike per channel and step.
        seed: seed of the weights and the input spikes.
    """

    batch: int = 16
    inputs: int = 200
    hidden: int = 128
    layers: int = 2
    density: float = 0.05
    seed: int = 0

    @property
    def widths(self) -> list[int]:
        """Layer sizes ``(inputs, hidden, ..., hidden)``."""
        return [self.inputs] + [self.hidden] * self.layers

    def model(self) -> LIFStack:
        """A fresh network with the workload's seed (same weights every call)."""
        torch.manual_seed(self.seed)
        model = LIFStack(self.widths)
        with torch.no_grad():  # strong enough weights that the layers spike
            for synapse in model.synapses:
                cast(nn.Linear, synapse).weight.mul_(4.0)  # LIFStack's synapses: Linear
        return model

    def spikes(self, T: int) -> Tensor:
        """The input spike train ``(T, batch, inputs)``, float32."""
        return spike_train(T, self.batch, self.inputs, self.density, seed=self.seed + 1)

    def with_hidden(self, hidden: int) -> Workload:
        """The same workload with another hidden width."""
        return Workload(self.batch, self.inputs, hidden, self.layers, self.density, self.seed)


def loss_of_rate(rate: Tensor) -> Tensor:
    """Scalar loss of the output firing rate ``(B, N)`` (spikes per step)."""
    return (rate - 0.1).square().mean()


# ----------------------------------------------------------------------------- context


@dataclass
class Context:
    """What a strategy needs to run one training step.

    Attributes:
        model: the network (its ``step`` is pure).
        x: input spikes ``(T, B, inputs)``; made before measuring, so not counted as device
            memory (it would stay on the host: ``scan`` moves one slice per step).
        state_bytes: ``S``, bytes of one state.
        step_bytes: ``A``, bytes autograd saves per taped step (the input slice excluded).
        plan_budget: device bytes the planner may use for states and tapes, or ``None``
            (each family's default).
        costs: measured operation times for the planner, in units of one forward step.
        directory: parent folder for the disk tier.
    """

    model: LIFStack
    x: Tensor
    state_bytes: int
    step_bytes: int
    plan_budget: int | None
    costs: plans.CostModel
    directory: str | None = None

    @property
    def T(self) -> int:
        """Sequence length in steps."""
        return int(self.x.shape[0])


@dataclass
class Outcome:
    """What one strategy run reports besides time and memory.

    Attributes:
        plan: the plan run (``repr``), or a description of the loop.
        bytes_off_device: bytes copied into the remote tier (host RAM or disk).
        forward_steps: step evaluations reported by ``scan`` (``None`` for other loops).
        modeled_bytes: the plan's modeled device peak of states and tapes (``scan`` only).
        budget_bytes: the plan budget the plan was chosen for (planned strategies only).
        note: what a reader of the row should know (e.g. the plan is not of the family asked).
    """

    plan: str
    bytes_off_device: int | None = None
    forward_steps: int | None = None
    modeled_bytes: int | None = None
    budget_bytes: int | None = None
    note: str = ""


Runner = Callable[[Context, Callable[[Any, Tensor], Any]], Outcome]


@dataclass(frozen=True)
class Strategy:
    """A named way to run a training step.

    Attributes:
        name: command-line name.
        label: text for tables and plots.
        run: ``run(context, step) -> Outcome``; ``step`` is the model's step (possibly wrapped
            to count evaluations). ``None`` when not available.
        remote: the remote tier it uses (``"host"``, ``"disk"``) or ``None``.
        note: why it is not available, or a caveat.
    """

    name: str
    label: str
    run: Runner | None
    remote: str | None = None
    note: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def available(self) -> bool:
        """Whether the strategy can run."""
        return self.run is not None


# ----------------------------------------------------------------------------- loops


def _loop(step: Callable[[Any, Tensor], Any], x: Tensor, state: Any) -> tuple[Any, Tensor]:
    """Run ``step`` over ``x``; returns the final state and the summed outputs."""
    total: Tensor | None = None
    for x_t in x:
        state, y = step(state, x_t)
        total = y if total is None else total + y
    assert total is not None
    return state, total


def run_bptt(ctx: Context, step: Callable[[Any, Tensor], Any]) -> Outcome:
    """Plain BPTT: one loop, autograd keeps every tape."""
    state = ctx.model.initial_state(ctx.x.shape[1])
    _, total = _loop(step, ctx.x, state)
    loss_of_rate(total / ctx.T).backward()
    return Outcome("loop", 0, None)


def _flat(state: State) -> list[Tensor]:
    return [t for layer in state for t in layer]


def _nest(leaves: list[Tensor] | tuple[Tensor, ...]) -> State:
    return tuple((leaves[i], leaves[i + 1]) for i in range(0, len(leaves), 2))


def run_checkpoint(ctx: Context, step: Callable[[Any, Tensor], Any]) -> Outcome:
    """``torch.utils.checkpoint`` per ``ceil(sqrt(T))``-step segment, non-reentrant."""
    T = ctx.T
    k = math.isqrt(T - 1) + 1

    def segment(xs: Tensor, *leaves: Tensor) -> tuple[Tensor, ...]:
        state, total = _loop(step, xs, _nest(leaves))
        return (*_flat(state), total)

    leaves = _flat(ctx.model.initial_state(ctx.x.shape[1]))
    total: Tensor | None = None
    for a in range(0, T, k):
        *leaves, part = checkpoint(segment, ctx.x[a : a + k], *leaves, use_reentrant=False)
        total = part if total is None else total + part
    assert total is not None
    loss_of_rate(total / T).backward()
    return Outcome(f"checkpoint every {k}", 0, None)


def run_save_on_cpu(ctx: Context, step: Callable[[Any, Tensor], Any]) -> Outcome:
    """``torch.autograd.graph.save_on_cpu(pin_memory=False)`` around the plain loop."""
    on_cpu = ctx.x.device.type == "cpu"
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        state = ctx.model.initial_state(ctx.x.shape[1])
        _, total = _loop(step, ctx.x, state)
        loss = loss_of_rate(total / ctx.T)
    loss.backward()
    # On the CPU, tensor.cpu() returns the tensor itself: nothing leaves the (same) memory.
    return Outcome("loop, tape on host", 0 if on_cpu else None, None)


# ----------------------------------------------------------------------------- scan


def pick_plan(family: str, ctx: Context, storage: str | None) -> plans.Plan | None:
    """The fastest plan of ``family`` whose modeled peak fits ``ctx.plan_budget``.

    ``family`` is ``"uniform"``, ``"revolve"``, ``"double"`` or ``"twolevel"``. Without a
    budget: the modeled peak of ``Uniform(ceil(sqrt(T)))``. Returns ``None`` when nothing of the
    family fits.
    """
    T, S, A = ctx.T, ctx.state_bytes, max(ctx.step_bytes, 1)
    sizes = plans.StepSizes(state=S, tape=A)
    budget = ctx.plan_budget
    if budget is None:  # the step Uniform(sqrt(T)) makes (its gradient buffers included: its
        # activations alone left the uniform row "no fit", every Uniform's step being larger)
        sqrt = plans.Uniform(math.isqrt(T - 1) + 1)
        cost = sqrt.cost(T, state_bytes=S, step_bytes=A)
        budget = step_bytes(T, sizes, sqrt, cost, remote_on_device=False).total
    kinds = {
        "uniform": plans.Uniform,
        "revolve": plans.Revolve,
        "double": plans.Double,
        "twolevel": plans.TwoLevel,
    }
    remote = storage is not None
    costs = ctx.costs
    if not remote:  # no remote tier: transfers do not happen
        costs = plans.CostModel(costs.forward, costs.backward, segment=costs.segment)
    if family == "twolevel":
        # rank() gives TwoLevel the most slots that fit; fewer slots are often faster to run
        # (fewer device states to shuffle): try a few and keep the fastest modeled one.
        best: tuple[float, plans.Plan] | None = None
        for slots in (2, 4, 8, 16, 32, 64):
            plan = plans.TwoLevel(slots, costs.write, costs.read, costs.forward, costs.backward)
            cost = plan.cost(T, state_bytes=S, step_bytes=A, costs=costs)
            if cost.peak_bytes <= budget and (best is None or cost.time < best[0]):
                best = (cost.time, plan)
        return best[1] if best else None
    # the one account: the plan budget is the step's (what ``fits`` leaves of the budget)
    candidates = plans.rank_steps(T, sizes, budget, remote=remote, costs=costs)
    for candidate in candidates:
        if type(candidate.plan) is kinds[family]:
            return candidate.plan
    return None


def _scan(ctx: Context, step: Callable[[Any, Tensor], Any], plan: Any, storage: str) -> Outcome:
    import spikeckpt as sc

    state = ctx.model.initial_state(ctx.x.shape[1])
    out = sc.scan(
        step,
        ctx.x,
        state,
        plan=plan,
        storage=storage,  # type: ignore[arg-type]
        readout="mean",
        params=list(ctx.model.parameters()),
        directory=ctx.directory if storage == "disk" else None,
    )
    rate, stats = out.ys, out.stats
    loss_of_rate(rate).backward()
    moved = sum(v for k, v in stats.bytes_written.items() if k in ("host", "disk"))
    modeled = None
    if isinstance(plan, plans.Plan):  # its modeled device peak for the measured S and A
        cost = plan.cost(ctx.T, state_bytes=ctx.state_bytes, step_bytes=ctx.step_bytes)
        modeled = cost.peak_bytes
    return Outcome(stats.plan, moved, stats.forward_steps, modeled)


class NoPlanFits(ConfigError):
    """No plan of the family fits the plan budget."""


def _family(family: str, storage: str | None) -> Runner:
    def run(ctx: Context, step: Callable[[Any, Tensor], Any]) -> Outcome:
        plan = pick_plan(family, ctx, storage)
        if plan is None:
            raise NoPlanFits(f"no {family} plan fits {ctx.plan_budget} bytes at T={ctx.T}")
        outcome = _scan(ctx, step, plan, storage or "device")
        outcome.budget_bytes = ctx.plan_budget
        ran = plan.as_run(ctx.T)
        if type(ran) is not type(plan):  # named for what it is
            outcome.plan = repr(ran)
            outcome.note = (
                f"at T={ctx.T} the fastest {type(plan).__name__} that fits, {plan!r}, keeps no "
                f"remote checkpoint: it is {ran!r}"
            )
        return outcome

    return run


def run_uniform_sqrt(ctx: Context, step: Callable[[Any, Tensor], Any]) -> Outcome:
    """``scan`` with ``Uniform(ceil(sqrt(T)))`` on the device."""
    return _scan(ctx, step, plans.Uniform(math.isqrt(ctx.T - 1) + 1), "device")


def run_twolevel_async(ctx: Context, step: Callable[[Any, Tensor], Any]) -> Outcome:
    """Kukreja et al.: disk checkpoint every ``ceil(write/forward)`` steps, Revolve(4) inside."""
    c = ctx.costs
    plan = plans.TwoLevel.asynchronous(4, max(c.write, c.forward), c.forward, c.read)
    return _scan(ctx, step, plan, "disk")


def _layerwise(storage: str) -> Runner:
    def run(ctx: Context, step: Callable[[Any, Tensor], Any]) -> Outcome:
        """``wrap(model.as_sequential(), granularity="layer")``, ``ceil(sqrt(T))``-step chunks."""
        import spikeckpt as sc

        k = math.isqrt(ctx.T - 1) + 1
        kwargs: dict[str, Any] = {"directory": ctx.directory} if storage == "disk" else {}
        seq = sc.wrap(
            ctx.model.as_sequential(),
            plan=plans.Uniform(k),
            storage=storage,  # type: ignore[arg-type]
            readout="mean",
            granularity="layer",
            **kwargs,
        )
        loss_of_rate(seq(ctx.x)).backward()
        stats = seq.last_stats
        moved = stats.storage_ledger.written.get(storage, 0)
        # the step counter counts LIFStack steps; the layer-wise blocks bypass it: report the
        # neuron steps per block instead (forward + one recomputation)
        return Outcome(
            f"layer-wise, chunks of {k}", moved, stats.forward_steps // len(stats.blocks)
        )

    return run


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("bptt", "BPTT loop", run_bptt),
        Strategy("checkpoint", "torch checkpoint sqrt(T)", run_checkpoint),
        Strategy(
            "save_on_cpu",
            "save_on_cpu",
            run_save_on_cpu,
            note="on a CPU-only machine the host is the device: no memory saved",
        ),
        Strategy("uniform-sqrt", "scan Uniform sqrt(T)", run_uniform_sqrt),
        Strategy("uniform", "scan Uniform (planned)", _family("uniform", None)),
        Strategy("revolve", "scan Revolve (planned)", _family("revolve", None)),
        Strategy("double-host", "scan Double host", _family("double", "host"), remote="host"),
        Strategy("double-disk", "scan Double disk", _family("double", "disk"), remote="disk"),
        Strategy("twolevel", "scan TwoLevel disk", _family("twolevel", "disk"), remote="disk"),
        Strategy(
            "twolevel-async",
            "scan TwoLevel async (Kukreja)",
            run_twolevel_async,
            remote="disk",
        ),
        Strategy("layerwise", "layer-wise host", _layerwise("host"), remote="host"),
        Strategy("layerwise-disk", "layer-wise disk", _layerwise("disk"), remote="disk"),
    )
}

#: Strategies run when ``--strategies`` is not given.
DEFAULT = tuple(name for name in STRATEGY_NAMES if name != "twolevel-async")


def available() -> list[str]:
    """Names of the strategies that can run."""
    return [name for name, s in STRATEGIES.items() if s.available]


def parse_strategies(text: str | None) -> list[Strategy]:
    """Strategies from a comma-separated list (``None``/``"all"``: the default set).

    Raises:
        ValueError: an unknown name; the message lists the valid ones.
    """
    if text is None or text.strip() in ("", "all"):
        names = list(DEFAULT)
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ConfigError(
            f"unknown strateg{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))};"
            f" valid strategies: {', '.join(STRATEGIES)} (or 'all')"
        )
    if "bptt" not in names:
        names.insert(0, "bptt")  # every ratio is to BPTT in the same run
    return [STRATEGIES[n] for n in dict.fromkeys(names)]
