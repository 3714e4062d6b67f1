"""Plan a :class:`~spikeckpt.CheckpointedSequence` to a device memory budget, per input shape.

A :class:`BudgetPlanner` is installed on a wrapped model (``seq.planner = BudgetPlanner(...)``,
which the Lightning callback does for you). At each forward it is asked for a plan; the first
time it sees an input shape it **probes** the model for one step (state bytes ``S``, bytes
taped per step ``A`` after spike packing, input spike density, forward/backward step time and
the storage tier's copy time), then picks the plan with the least modeled time that fits with
:func:`spikeckpt.plans.choose`, and caches it for that shape. The probe changes nothing: no
gradient is accumulated, the RNG is forked, the framework's hidden state is cleaned up.

Across processes (DDP) the planner agrees with the other ranks through two functions set by
the caller: ``reduce_max`` (the planned ``T`` and batch are the largest over the ranks) and
``broadcast`` (rank 0's measurements are used), so every rank chooses the same plan.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from spikeckpt import plans
from spikeckpt.engine.probe import probe_step
from spikeckpt.engine.tree import leaf_bytes, tree_flatten
from spikeckpt.plans import Cost, CostModel, Plan, choose
from spikeckpt.storage.base import Ledger
from spikeckpt.storage.tiers import make_store
from spikeckpt.units import format_bytes, parse_bytes

if TYPE_CHECKING:  # pragma: no cover
    from spikeckpt.wrapping import CheckpointedSequence

ShapeKey = tuple[int, int]


@dataclass(frozen=True)
class Probe:
    """What one step of a wrapped model costs, measured at one batch size.

    Attributes:
        batch: batch size of the probe.
        state_bytes: ``S``, bytes of the whole state.
        step_bytes: ``A``, bytes autograd keeps for one taped step (binary tensors packed).
        output_bytes: bytes of one step's output (the ``(B, ...)`` slice of ``y``).
        input_density: fraction of ones in the input step when it is binary, else None.
        forward_seconds: one untaped step.
        backward_seconds: backpropagating one taped step.
        write_seconds: storing one state in the remote tier.
        read_seconds: loading one state back from the remote tier.
        segment_seconds: the fixed cost of one backward call over a taped segment, whatever
            its length (a few steps taped and backpropagated one by one, minus the same steps
            in one call, per extra call). It makes the planner prefer multi-step tapes.
    """

    batch: int
    state_bytes: int
    step_bytes: int
    output_bytes: int
    input_density: float | None
    forward_seconds: float
    backward_seconds: float
    write_seconds: float
    read_seconds: float
    segment_seconds: float = 0.0

    def scaled(self, batch: int) -> Probe:
        """The same probe for another batch size (bytes scale linearly with the batch)."""
        if batch == self.batch:
            return self

        def scale(n: int) -> int:
            return -(-n * batch // self.batch)

        return replace(
            self,
            batch=batch,
            state_bytes=scale(self.state_bytes),
            step_bytes=scale(self.step_bytes),
            output_bytes=scale(self.output_bytes),
        )

    def costs(self) -> CostModel:
        """The probe's times as a :class:`CostModel` (seconds)."""
        return CostModel(
            forward=self.forward_seconds,
            backward=self.backward_seconds,
            write=self.write_seconds,
            read=self.read_seconds,
            segment=self.segment_seconds,
        )


@dataclass(frozen=True)
class PlanChoice:
    """A chosen plan and why.

    Attributes:
        plan: the plan, intervals filled in for ``T``.
        T: steps planned for.
        batch: batch size planned for.
        budget_bytes: the device budget the plan had to fit (outputs already subtracted).
        probe: the measurements used.
        modeled: the plan's modeled cost (counts, ``peak_bytes``, ``time`` in seconds).
    """

    plan: Plan
    T: int
    batch: int
    budget_bytes: int
    probe: Probe
    modeled: Cost

    @property
    def modeled_peak_bytes(self) -> int:
        """Modeled device peak of checkpoints and tapes (bytes)."""
        return self.modeled.peak_bytes

    @property
    def time_factor(self) -> float:
        """Modeled time relative to plain BPTT."""
        return self.modeled.time_factor(self.probe.costs())

    @property
    def recompute_factor(self) -> float:
        """Step evaluations per time step (1.0 for BPTT)."""
        return self.modeled.recompute_factor

    def summary(self) -> str:
        """One line: plan, modeled peak, time factor."""
        return (
            f"{self.plan!r} for T={self.T}, B={self.batch}: modeled peak "
            f"{format_bytes(self.modeled_peak_bytes)} of {format_bytes(self.budget_bytes)}, "
            f"{self.recompute_factor:.2f} evaluations/step, ~{self.time_factor:.2f}x BPTT time"
        )


def _median_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_model(seq: CheckpointedSequence, x: Tensor, state: Any, storage: str) -> Probe:
    """Measure one step of ``seq`` on the first step of ``x`` ``(T, B, ...)`` from ``state``.

    Changes nothing: gradients are taken with ``torch.autograd.grad`` (no ``.grad`` is
    touched), the RNG is forked, and the framework's per-module state is cleaned up.
    """
    params = seq.parameters_for_scan()
    x_t = x[0]
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            pack = bool(seq.scan_kwargs.get("pack_tape", False))
            sizes = probe_step(seq.step, state, x_t, params, pack=pack)
            with torch.no_grad():
                _, y = seq.step(state, x_t)
            output_bytes = leaf_bytes(tree_flatten(y)[0])
            costs = step_costs(seq.step, state, x, params, storage)
    finally:
        seq.adapter.cleanup()
    density = None
    if x_t.is_floating_point() and x_t.numel() and bool(((x_t == 0) | (x_t == 1)).all()):
        density = float(x_t.mean())
    return Probe(
        batch=int(x.shape[1]),
        state_bytes=sizes.state_bytes,
        step_bytes=max(1, sizes.step_bytes),
        output_bytes=output_bytes,
        input_density=density,
        forward_seconds=costs.forward,
        backward_seconds=costs.backward,
        write_seconds=costs.write,
        read_seconds=costs.read,
        segment_seconds=costs.segment,
    )


def step_costs(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    xs: Tensor,
    params: list[Tensor],
    storage: str = "device",
) -> CostModel:
    """Measure a step's operation times (seconds) as a :class:`~spikeckpt.plans.CostModel`.

    Args:
        step: ``step(state, x_t) -> (state, y_t)``.
        state: the state to start from (not changed).
        xs: ``(n, B, ...)`` inputs; the first step times forward and backward, up to
            :data:`SEGMENT_PROBE_STEPS` steps time the per-call overhead
            (:func:`segment_seconds`).
        params: the parameters the step uses (their ``.grad`` is not touched).
        storage: tier whose copy time is measured (``"device"``: no copies).

    Example:
        >>> import torch, spikeckpt
        >>> from spikeckpt.models import LIFStack
        >>> net = LIFStack((20, 32, 5))
        >>> xs = torch.rand(4, 8, 20)
        >>> from spikeckpt.planner import step_costs
        >>> costs = step_costs(net.step, net.initial_state(8), xs,
        ...                    list(net.parameters()), "host")
        >>> costs.forward > 0 and costs.backward > 0
        True
    """
    x_t = xs[0]
    leaves, treedef = tree_flatten(state)
    wrt_params = [p for p in params if p.requires_grad]
    with torch.no_grad():
        forward = _median_seconds(lambda: step(state, x_t))

    def one_taped_step() -> None:
        _taped_grad(step, treedef, xs, 0, 1, leaves, wrt_params)

    one_taped_step()  # warm-up
    backward = max(_median_seconds(one_taped_step) - forward, 1e-9)
    segment = segment_seconds(step, state, xs[:SEGMENT_PROBE_STEPS], params)
    write, read = _copy_seconds(leaves, storage, x_t.device)
    return CostModel(forward=forward, backward=backward, write=write, read=read, segment=segment)


def _taped_grad(
    step: Callable[[Any, Any], tuple[Any, Any]],
    treedef: Any,
    xs: Tensor,
    a: int,
    b: int,
    start: list[Tensor],
    wrt_params: list[Tensor],
) -> tuple[list[Tensor], list[Tensor | None]]:
    """Run steps ``a..b-1`` of ``xs`` taped from the state leaves ``start`` and take the
    gradients of all outputs (ones) in one ``torch.autograd.grad`` call.

    Returns the final state leaves (detached) and the gradients for the state leaves that
    require grad followed by ``wrt_params``.
    """
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in start]
    with torch.enable_grad():
        current: Any = treedef.unflatten(inputs)
        outs: list[Tensor] = []
        for t in range(a, b):
            current, y = step(current, xs[t])
            outs += [v for v in tree_flatten(y)[0] if v.requires_grad]
        last = tree_flatten(current)[0]
        outs += [v for v in last if v.requires_grad]
        wrt = [v for v in inputs if v.requires_grad] + wrt_params
        if not outs or not wrt:
            return [v.detach() for v in last], []
        found = torch.autograd.grad(
            outs, wrt, [torch.ones_like(v) for v in outs], allow_unused=True
        )
    return [v.detach() for v in last], list(found)


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return b if a is None else a if b is None else a + b


#: Steps :func:`segment_seconds` runs (taped in one call, then one call per step).
SEGMENT_PROBE_STEPS = 16


def segment_seconds(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    xs: Tensor,
    params: list[Tensor],
    repeats: int = 3,
) -> float:
    """Seconds one backward call costs beyond the steps it backpropagates.

    Runs the ``n = len(xs)`` steps of ``xs`` ``(n, B, ...)`` taped and backpropagates them in
    one ``torch.autograd.grad`` call, then tapes and backpropagates each step on its own (as a
    schedule of single-step tapes does: one call per step, parameter gradients summed between
    calls). Returns ``(t_single - t_one) / (n - 1)`` (median of ``repeats``), at least 0; 0
    when ``n < 2``. Gradients go to fresh tensors: ``.grad`` is untouched.
    """
    n = int(xs.shape[0])
    if n < 2:
        return 0.0
    leaves, treedef = tree_flatten(state)
    wrt_params = [p for p in params if p.requires_grad]

    def one_call() -> None:
        _taped_grad(step, treedef, xs, 0, n, leaves, wrt_params)

    def per_step() -> None:
        current, total = leaves, None
        for t in range(n):
            current, found = _taped_grad(step, treedef, xs, t, t + 1, current, wrt_params)
            grads = found[len(found) - len(wrt_params) :] if wrt_params else []
            # parameter gradients add up between calls, as in the executor
            total = (
                grads if total is None else [_add(s, g) for s, g in zip(total, grads, strict=True)]
            )

    one_call()  # warm-up
    per_step()
    single = _median_seconds(per_step, repeats)
    joint = _median_seconds(one_call, repeats)
    return max(0.0, (single - joint) / (n - 1))


def _copy_seconds(leaves: list[Tensor], storage: str, device: torch.device) -> tuple[float, float]:
    """Time to write one state to the remote tier and read it back (0 for the device tier)."""
    if storage == "device":
        return 0.0, 0.0
    store = make_store(storage, device, Ledger())
    try:
        tensors = [t.detach() for t in leaves]
        start = time.perf_counter()
        store.put(0, tensors)
        store.prefetch(0)
        store.get(0)
        round_trip = time.perf_counter() - start
    finally:
        store.close()
    return round_trip / 2, round_trip / 2


class BudgetPlanner:
    """Choose and cache a plan per input shape so a wrapped model fits ``budget`` bytes.

    Args:
        budget: device bytes (int or a string like ``"2GiB"``) for this model's activations:
            checkpoints, tapes and the stacked outputs.
        remote: allow plans with off-device checkpoints (needs ``storage`` host or disk).
        costs: fixed operation times; None measures them with the probe.

    Attributes:
        choices: shape ``(T, B)`` -> :class:`PlanChoice`.
        probes: how many probes ran (a resumed run with known shapes runs none).
        reduce_max: set by a distributed caller: ``int -> int`` max over ranks.
        broadcast: set by a distributed caller: ``obj -> rank 0's obj``.
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

    def __call__(self, seq: CheckpointedSequence, x: Tensor, state: Any) -> Plan:
        """The plan for input ``x`` ``(T, B, ...)`` (time first) starting from ``state``."""
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
            choice = self._plan(seq, x, state, T, batch)
            self.choices[key] = choice
        self.last = choice
        return choice.plan

    def _plan(
        self, seq: CheckpointedSequence, x: Tensor, state: Any, T: int, batch: int
    ) -> PlanChoice:
        probe = probe_model(seq, x, state, seq.storage)
        self.probes += 1
        if self.broadcast is not None:
            probe = self.broadcast(probe)
        probe = probe.scaled(batch)
        costs = self.costs or probe.costs()
        outputs = 2 * T * probe.output_bytes if seq.readout is None else 0
        budget = self.budget_bytes - outputs
        remote = self.remote and seq.storage != "device"
        plan = choose(
            T, probe.state_bytes, probe.step_bytes, max(budget, 0), remote=remote, costs=costs
        ).for_length(T)
        modeled = plan.cost(
            T, state_bytes=probe.state_bytes, step_bytes=probe.step_bytes, costs=costs
        )
        return PlanChoice(plan, T, batch, budget, probe, modeled)

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
    }


def _choice_from_dict(item: dict[str, Any]) -> PlanChoice:
    plan_class = getattr(plans, item["plan"]["type"])
    return PlanChoice(
        plan=plan_class(**item["plan"]["args"]),
        T=item["T"],
        batch=item["batch"],
        budget_bytes=item["budget_bytes"],
        probe=Probe(**item["probe"]),
        modeled=Cost(**item["modeled"]),
    )
