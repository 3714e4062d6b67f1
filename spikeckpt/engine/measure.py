"""The measuring room: what one step costs in bytes and seconds, measured one way for everyone.

[`probe_step`][spikeckpt.engine.measure.probe_step] measures one step of a step function: the state's bytes ``S``, the bytes
autograd keeps for a taped step ``A`` (after spike packing when asked), one step's output
bytes, its working memory beyond ``S`` and ``A`` ([`work_bytes`][spikeckpt.engine.measure.work_bytes]), and the operation
times ([`step_costs`][spikeckpt.engine.measure.step_costs]: a forward step, a backward step, the fixed cost of one backward
call, one state's write to and read from the storage tier). ``scan(plan="auto")``, the
planners of [`spikeckpt.planning`][spikeckpt.planning], [`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget] and the
benchmarks all measure here, with one statistic: the **least** time over ``repeats`` runs
(the run least disturbed by the rest of the machine).

Measuring changes nothing: the RNG is forked, gradients go to fresh tensors (no ``.grad`` is
touched), and the steps run inside `recompute_phase`, so layers
with side effects (BatchNorm's running statistics) skip them. A probe of the same step, shapes,
tier and limit is measured once per process ([`probe_step`][spikeckpt.engine.measure.probe_step] keeps the last few), so two
callers planning the same step for the same budget plan from the same numbers.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from spikeckpt.engine.meter import MemoryMeter
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.engine.planned import owner_signature
from spikeckpt.engine.rng import CPU_STATE_BYTES, cuda_devices
from spikeckpt.engine.saved import measure_step
from spikeckpt.engine.tree import is_float, leaf_bytes, tree_flatten
from spikeckpt.plans.account import StepSizes
from spikeckpt.plans.simulate import CostModel
from spikeckpt.storage.base import Ledger, tensor_nbytes
from spikeckpt.storage.tiers import make_store

__all__ = [
    "REPEATS",
    "SEGMENT_PROBE_STEPS",
    "Probe",
    "copy_seconds",
    "probe_step",
    "segment_seconds",
    "step_costs",
    "trainable_bytes",
    "work_bytes",
]

Step = Callable[[Any, Any], tuple[Any, Any]]

#: Steps [`segment_seconds`][spikeckpt.engine.measure.segment_seconds] runs (taped in one call, then one call per step).
SEGMENT_PROBE_STEPS = 16
#: Runs of each timed operation; the least time is kept.
REPEATS = 3


@dataclass(frozen=True)
class Probe:
    """What one step costs, measured at one batch size.

    Attributes:
        batch: batch size of the probe.
        state_bytes: ``S``, bytes of the whole state.
        step_bytes: ``A``, bytes autograd keeps for one taped step (binary tensors packed
            when the run packs its tape).
        output_bytes: bytes of one step's output (the ``(B, ...)`` slice of ``y``).
        input_density: fraction of ones in the input step when it is binary, else None.
        forward_seconds: one untaped step.
        backward_seconds: backpropagating one taped step.
        write_seconds: storing one state in the remote tier.
        read_seconds: loading one state back from the remote tier.
        segment_seconds: the fixed cost of one backward call over a taped segment, whatever
            its length ([`segment_seconds`][spikeckpt.engine.measure.segment_seconds]). It makes the planner prefer multi-step tapes.
        work_bytes: what running one step holds on the device beyond the plan's states and
            tapes ([`work_bytes`][spikeckpt.engine.measure.work_bytes]).
        work_capped: ``work_bytes`` was measured without the parameters' gradients (the
            probe's ``max_bytes`` had no room for them); [`work_bytes`][spikeckpt.engine.measure.work_bytes] with all the
            parameters measures it with them.
        rng_bytes: bytes of generator state each checkpoint keeps in the compute device's
            memory: on the CPU, a step that draws random numbers (Dropout) makes the engine
            keep the CPU generator's state (5,056 bytes) with every checkpoint, made without an
            op (`MemoryMeter`'s tensor mode does not see it); 0 when the step draws nothing or
            runs on CUDA (its generator states are host memory).
        rng_start_bytes: the generator states the stack engine holds beside the plan: the
            one it captures at the start of a run and holds to its end, and the one it captures
            to compare with it (at each stored checkpoint of the forward pass and at its end:
            whether the steps drew); on the CPU 2 x 5,056 bytes, in the work beside the plan;
            0 on CUDA.
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
    work_bytes: int = 0
    work_capped: bool = False
    rng_bytes: int = 0
    rng_start_bytes: int = 0

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
            work_bytes=scale(self.work_bytes),
        )

    def costs(self) -> CostModel:
        """The probe's times as a [`CostModel`][spikeckpt.plans.simulate.CostModel] (seconds)."""
        return CostModel(
            forward=self.forward_seconds,
            backward=self.backward_seconds,
            write=self.write_seconds,
            read=self.read_seconds,
            segment=self.segment_seconds,
        )

    def sizes(
        self,
        params: Sequence[Tensor],
        *,
        input_bytes: int,
        stacked: bool,
        grad_in_step: bool = True,
    ) -> StepSizes:
        """What the account needs of this probe ([`StepSizes`][spikeckpt.plans.account.StepSizes],
        bytes): its state, tape, working and output bytes, ``input_bytes`` of input on the
        device, the outputs ``stacked`` or not, and the gradients of the ``params`` that require
        grad (``.grad`` in the step unless ``grad_in_step`` is False)."""
        trainable = [p for p in params if p.requires_grad]
        return StepSizes(
            state=self.state_bytes + self.rng_bytes,  # a checkpoint keeps both
            tape=self.step_bytes,
            work=self.work_bytes + self.rng_start_bytes,
            output=self.output_bytes,
            input=input_bytes,
            stacked=stacked,
            grads=trainable_bytes(trainable),
            largest=max((tensor_nbytes(p) for p in trainable), default=0),
            grad_in_step=grad_in_step,
        )


def trainable_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of the distinct tensors among ``tensors`` that require grad (one gradient each)."""
    seen: dict[int, Tensor] = {}
    for t in tensors:
        if t.requires_grad:
            seen.setdefault(id(t), t)
    return sum(tensor_nbytes(t) for t in seen.values())


def _least_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = REPEATS) -> float:
    """The least wall time of ``repeats`` calls of ``fn`` (CUDA synchronised)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


# ----------------------------------------------------------------------------- the probe

_CACHE_SIZE = 16
_LOCK = threading.Lock()
_PROBES: OrderedDict[Any, Probe] = OrderedDict()


def _key(step: Step, state: Any, x0: Any, params: Sequence[Tensor], *extra: Any) -> Any:
    """What a probe depends on: the step's code (and its owner: `owner_signature`), the
    shapes, dtypes and devices of the state, one step's input and the parameters, the owner's
    modules' training modes, and ``extra``."""
    step = getattr(step, "__wrapped__", step)  # scan(..., steps=n) wraps the user's step
    owner = getattr(step, "__self__", None)
    func = getattr(step, "__func__", step)
    code = getattr(func, "__code__", None) or type(step)
    leaves = [t for t in (*tree_flatten(state)[0], *tree_flatten(x0)[0], *params)]
    shapes = tuple(
        (tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
        for t in leaves
        if isinstance(t, Tensor)
    )
    modes = tuple(m.training for m in owner.modules()) if isinstance(owner, nn.Module) else ()
    return (code, owner_signature(owner), shapes, modes, *extra)


def probe_step(
    step: Step,
    state: Any,
    x_at: Callable[[int], Any],
    T: int,
    params: Sequence[Tensor],
    *,
    storage: str,
    device: torch.device,
    directory: str | os.PathLike[str] | None = None,
    pack: bool = False,
    max_bytes: int | None = None,
    batch: int = 1,
    exclude: Sequence[Tensor] = (),
) -> Probe:
    """Measure one step of ``step`` from ``state`` on the inputs ``x_at(t)`` (``t < T``).

    ``max_bytes``: device bytes the probe may hold at once (None: no limit). It first tapes one
    step (``S + A``); the timing runs then tape at most as many steps (up to
    `SEGMENT_PROBE_STEPS`) as fit with the parameters' gradients counted: about
    ``2S + 3G + 2n * (A + output + input step)``. When not even two steps fit that way the
    per-call overhead is taken as 0; when not even one step with ``G`` fits, the backward is
    timed without the parameters' gradients (``work_capped``).

    ``exclude``: tensors whose storage autograd may save at no cost (the input on the
    device: a step's slice is a view of it), left out of ``A`` like the parameters.

    A probe of the same step code, shapes, ``T`` (up to `SEGMENT_PROBE_STEPS`), tier,
    packing, limit and excluded tensors' shapes is measured once and kept (the last 16).
    """
    params = [p for p in params if p.requires_grad]
    x0 = x_at(0)
    rng = _rng_bytes(step, state, x0, device)
    # whether the step draws and its modules' modes are in the key: Dropout(p=0) or in eval
    # mode draws nothing and tapes no mask, with the same code and shapes
    # what is excluded changes the step's bytes: a packed input's unpacked slices are taped,
    # a dense one's are views of it (the same step code and shapes otherwise)
    excluded = tuple((tuple(t.shape), t.dtype, t.device.type) for t in exclude)
    key = _key(
        step,
        state,
        x0,
        params,
        min(T, SEGMENT_PROBE_STEPS),
        storage,
        pack,
        max_bytes,
        rng,
        excluded,
    )
    with _LOCK:
        found = _PROBES.get(key)
    if found is not None:
        return replace(found, batch=batch)
    with torch.random.fork_rng(devices=cuda_devices(tree_flatten(x0)[0])), recompute_phase():
        sizes = measure_step(step, state, x0, [*params, *exclude], pack=pack)
        with torch.no_grad():
            _, y = step(state, x0)
        output = leaf_bytes(tree_flatten(y)[0])
        del y
        per_step = max(1, sizes.step_bytes) + output + leaf_bytes(tree_flatten(x0)[0])
        steps, timed = _timed_steps(min(SEGMENT_PROBE_STEPS, T), sizes, per_step, params, max_bytes)
        xs = [x0, *(x_at(t) for t in range(1, steps))]
        costs = step_costs(step, state, xs, timed, storage, directory=directory)
        work = work_bytes(step, state, x0, timed, sizes.step_bytes, device)
    probe = Probe(
        batch=batch,
        state_bytes=sizes.state_bytes,
        step_bytes=max(1, sizes.step_bytes),
        output_bytes=output,
        input_density=None,
        forward_seconds=costs.forward,
        backward_seconds=costs.backward,
        write_seconds=costs.write,
        read_seconds=costs.read,
        segment_seconds=costs.segment,
        work_bytes=work,
        work_capped=len(timed) < len(params),
        rng_bytes=rng,
        rng_start_bytes=2 * CPU_STATE_BYTES if device.type == "cpu" else 0,
    )
    with _LOCK:
        _PROBES[key] = probe
        while len(_PROBES) > _CACHE_SIZE:
            _PROBES.popitem(last=False)
    return probe


def _rng_bytes(step: Step, state: Any, x0: Any, device: torch.device) -> int:
    """`Probe.rng_bytes`: the CPU generator's state size when one untaped step on the CPU
    draws random numbers from it, else 0 (the generators are left as they were)."""
    if device.type != "cpu":
        return 0
    with torch.random.fork_rng(devices=[]), recompute_phase(), torch.no_grad():
        generator = torch.get_rng_state()
        step(state, x0)
        return CPU_STATE_BYTES if not torch.equal(generator, torch.get_rng_state()) else 0


def _timed_steps(
    steps: int, sizes: Any, per_step: int, params: list[Tensor], max_bytes: int | None
) -> tuple[int, list[Tensor]]:
    """How many steps the timing runs tape, and the parameters they differentiate, under
    ``max_bytes`` (see [`probe_step`][spikeckpt.engine.measure.probe_step])."""
    if max_bytes is None:
        return steps, params
    room = max_bytes - 2 * sizes.state_bytes
    grads = trainable_bytes(params)
    # each taped step twice: its tape, and the gradients its backward makes beside it
    # (a convolution's taped steps measured 1.6x their saved bytes: 10 steps ran a 1.1x
    # budget over by 1% when counted once)
    taped = 2 * per_step
    if room - 3 * grads >= 2 * taped:
        return min(steps, (room - 3 * grads) // taped), params
    # no per-call overhead measured; without room for G the backward is timed without it
    return 1, (params if room - grads >= per_step else [])


def work_bytes(
    step: Step,
    state: Any,
    x0: Any,
    params: Sequence[Tensor],
    step_bytes: int,
    device: torch.device,
) -> int:
    """One step's working memory: the larger of one untaped step's peak (its new state, output
    and temporaries) and one taped step's backward peak beyond its tape (``step_bytes``) and
    the parameters' gradients (measured with [`MemoryMeter`][spikeckpt.engine.meter.MemoryMeter])."""
    leaves, treedef = tree_flatten(state)
    with torch.random.fork_rng(devices=cuda_devices(leaves)), recompute_phase():
        with torch.no_grad(), MemoryMeter(device) as untaped:
            out = step(state, x0)
            del out
        wrt = [p for p in params if p.requires_grad]
        with MemoryMeter(device) as taped:
            found = _taped_grad(step, treedef, [x0], 0, 1, leaves, wrt)
            del found
    backward = taped.peak_bytes - step_bytes - trainable_bytes(wrt)
    return max(untaped.peak_bytes, backward, 0)


# ----------------------------------------------------------------------------- times


def step_costs(
    step: Step,
    state: Any,
    xs: Tensor | Sequence[Any],
    params: Sequence[Tensor],
    storage: str = "device",
    *,
    directory: str | os.PathLike[str] | None = None,
    repeats: int = REPEATS,
) -> CostModel:
    """Measure a step's operation times (seconds) as a [`CostModel`][spikeckpt.plans.simulate.CostModel].

    Args:
        step: ``step(state, x_t) -> (state, y_t)``.
        state: the state to start from (not changed).
        xs: per-step inputs (a ``(n, B, ...)`` tensor or a list); the first step times
            forward and backward, up to `SEGMENT_PROBE_STEPS` steps time the per-call
            overhead ([`segment_seconds`][spikeckpt.engine.measure.segment_seconds]).
        params: the parameters the step uses (their ``.grad`` is not touched).
        storage: tier whose copy time is measured (``"device"``: no copies).
        directory: the disk tier's parent folder.
        repeats: runs of each operation (the least time is kept).

    Example:
        >>> import torch, spikeckpt
        >>> from spikeckpt.models import LIFStack
        >>> net = LIFStack((20, 32, 5))
        >>> xs = torch.rand(4, 8, 20)
        >>> from spikeckpt.planning import step_costs
        >>> costs = step_costs(net.step, net.initial_state(8), xs,
        ...                    list(net.parameters()), "host")
        >>> costs.forward > 0 and costs.backward > 0
        True
    """
    x_t = xs[0]
    leaves, treedef = tree_flatten(state)
    wrt = [p for p in params if p.requires_grad]
    device = _device_of(leaves, x_t)
    with torch.random.fork_rng(devices=cuda_devices(leaves)), recompute_phase():
        with torch.no_grad():
            step(state, x_t)  # warm-up
            forward = _least_seconds(lambda: step(state, x_t), device, repeats)

        def one_taped_step() -> None:
            _taped_grad(step, treedef, xs, 0, 1, leaves, wrt)

        one_taped_step()  # warm-up
        backward = max(_least_seconds(one_taped_step, device, repeats) - forward, 1e-9)
        segment = segment_seconds(step, state, xs[:SEGMENT_PROBE_STEPS], wrt, repeats)
    write, read = copy_seconds(leaves, storage, device, directory)
    return CostModel(
        forward=max(forward, 1e-9), backward=backward, write=write, read=read, segment=segment
    )


def _device_of(leaves: Sequence[Any], x_t: Any) -> torch.device:
    for t in (*leaves, *tree_flatten(x_t)[0]):
        if isinstance(t, Tensor):
            return t.device
    return torch.device("cpu")


def _taped_grad(
    step: Step,
    treedef: Any,
    xs: Tensor | Sequence[Any],
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
    inputs = [
        _detached(t).requires_grad_(is_float(t)) if isinstance(t, Tensor) else t for t in start
    ]
    with torch.enable_grad():
        current: Any = treedef.unflatten(inputs)
        outs: list[Tensor] = []
        for t in range(a, b):
            current, y = step(current, xs[t])
            outs += [v for v in tree_flatten(y)[0] if isinstance(v, Tensor) and v.requires_grad]
        last = tree_flatten(current)[0]
        outs += [v for v in last if isinstance(v, Tensor) and v.requires_grad]
        wrt = [v for v in inputs if isinstance(v, Tensor) and v.requires_grad] + wrt_params
        if not outs or not wrt:
            return [_detached(v) for v in last], []
        found = torch.autograd.grad(
            outs, wrt, [torch.ones_like(v) for v in outs], allow_unused=True
        )
    return [_detached(v) for v in last], list(found)


def _detached(leaf: Any) -> Any:
    """A state leaf without its graph: a tensor detached, anything else (a ``None`` entry of
    a Norse ``SequentialState``'s state list) as it is."""
    return leaf.detach() if isinstance(leaf, Tensor) else leaf


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return b if a is None else a if b is None else a + b


def segment_seconds(
    step: Step,
    state: Any,
    xs: Tensor | Sequence[Any],
    params: Sequence[Tensor],
    repeats: int = REPEATS,
) -> float:
    """Seconds one backward call costs beyond the steps it backpropagates.

    Runs the ``n = len(xs)`` steps of ``xs`` taped and backpropagates them in one
    ``torch.autograd.grad`` call, then tapes and backpropagates each step on its own (as a
    schedule of single-step tapes does: one call per step, parameter gradients summed between
    calls). Returns ``(t_single - t_one) / (n - 1)`` (least of ``repeats``), at least 0; 0
    when ``n < 2``. Gradients go to fresh tensors: ``.grad`` is untouched.
    """
    n = len(xs)
    if n < 2:
        return 0.0
    leaves, treedef = tree_flatten(state)
    wrt = [p for p in params if p.requires_grad]
    device = _device_of(leaves, xs[0])

    def one_call() -> None:
        _taped_grad(step, treedef, xs, 0, n, leaves, wrt)

    def per_step() -> None:
        current, total = leaves, None
        for t in range(n):
            current, found = _taped_grad(step, treedef, xs, t, t + 1, current, wrt)
            grads = found[len(found) - len(wrt) :] if wrt else []
            # parameter gradients add up between calls, as in the executor
            total = (
                grads if total is None else [_add(s, g) for s, g in zip(total, grads, strict=True)]
            )

    one_call()  # warm-up
    per_step()
    single = _least_seconds(per_step, device, repeats)
    joint = _least_seconds(one_call, device, repeats)
    return max(0.0, (single - joint) / (n - 1))


def copy_seconds(
    leaves: Sequence[Tensor],
    storage: str,
    device: torch.device,
    directory: str | os.PathLike[str] | None = None,
    repeats: int = REPEATS,
) -> tuple[float, float]:
    """One state written to the tier and read back (least of ``repeats``), halved: the
    write and the read time; 0 for the device tier."""
    if storage == "device":
        return 0.0, 0.0
    store = make_store(storage, device, Ledger(), directory)
    try:
        tensors = [t.detach() for t in leaves if isinstance(t, Tensor)]
        best = float("inf")
        for key in range(repeats):
            start = time.perf_counter()
            store.put(key, tensors)
            store.prefetch(key)
            store.get(key)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
            store.drop(key)
    finally:
        store.close()
    return best / 2, best / 2
