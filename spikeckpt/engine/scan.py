"""``spikeckpt.scan``: run a step function over time with a checkpointing plan and exact gradients.

``scan`` wraps the whole time loop in one custom `Function`. Its forward
runs the schedule's forward phase (untaped steps, stores, and the taped segments a plan keeps
from the forward pass); its backward runs the backward phase (loads, recomputation,
backpropagation of each taped segment with `grad`, carrying the state
gradient and accumulating parameter and input gradients). See
`spikeckpt.engine.executor` for the memory ledger convention.

The pieces: `spikeckpt.engine.step` (the user's step on flat leaves, parameter discovery,
the running-statistics guard), `spikeckpt.engine.planned` (the schedule to run, cached),
`spikeckpt.engine.first_step` (step 0 run apart for states it shapes); this module runs
them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import Tensor

from spikeckpt.engine.amp import autocast_on
from spikeckpt.engine.executor import Executor
from spikeckpt.engine.first_step import changes_dtype, first_step
from spikeckpt.engine.function import SECOND_BACKWARD, Job, refuse_func_transforms, run_job
from spikeckpt.engine.grad import grads_held, tensor_hooks_held
from spikeckpt.engine.inputs import (
    as_input,
    drop_first,
    is_packed,
    step_of,
)
from spikeckpt.engine.outer_compile import eager_under_compile
from spikeckpt.engine.phase import uncached_parametrizations
from spikeckpt.engine.planned import (
    check_plan,
    needs_measuring,
    plan_key,
    planned,
    schedule_of,
    simulate_cached,
)
from spikeckpt.engine.readout import Readout, Reducer, check_readout
from spikeckpt.engine.rng import cuda_devices, generators_kept
from spikeckpt.engine.scan_budget import measured_plan
from spikeckpt.engine.scan_options import ScanOptions, Timed
from spikeckpt.engine.stats import ScanResult, ScanStats
from spikeckpt.engine.step import (
    StepFn,
    default_params,
    no_own_draws,
    reachable_generators,
    time_leaves,
    unshaped,
)
from spikeckpt.engine.tree import (
    TreeDef,
    leaf_bytes,
    refuse_non_tensor_leaves,
    tree_flatten,
    tree_leaves,
    tree_map,
)
from spikeckpt.errors import (
    ConfigError,
    ConfigTypeError,
    UsageError,
)
from spikeckpt.plans.account import (
    StepBytes,
    tier_note,
)
from spikeckpt.plans.schedule import Schedule
from spikeckpt.storage.codecs import require_binary
from spikeckpt.storage.tiers import check_storage, make_store
from spikeckpt.units import parse_bytes

__all__ = ["ScanResult", "ScanStats", "scan"]

Storage = Literal["device", "host", "disk"]
#: steps run apart before the checkpointed run, at most, while each changes a state's dtype
MAX_APART = 3


# ----------------------------------------------------------------------------- the Function


class _Job(Job):
    """The schedule executor's run as a `Job`.

    Function inputs: (*initial state leaves, *input leaves, *params); outputs:
    (*readout outputs, *final state leaves).
    """

    def __init__(
        self,
        fn: StepFn,
        schedule: Schedule,
        reducer: Reducer | None,
        *,
        n_state: int,
        n_inputs: int,
        storage: str,
        device: torch.device,
        directory: str | os.PathLike | None,
        cuda: Sequence[int],
        stats: ScanStats,
        pack_tape: bool,
    ) -> None:
        super().__init__(device, cuda, storage, directory, stats)
        self.fn = fn
        self.schedule = schedule
        self.reducer = reducer
        self.n_state = n_state
        self.n_inputs = n_inputs
        self.pack_tape = pack_tape
        self.executor: Executor | None = None
        self.n_outputs = 0
        self.referenced = list(range(n_state, n_state + n_inputs))  # backward slices inputs

    def forward(self, needs: Sequence[bool], tensors: Sequence[Tensor]) -> list[Tensor]:
        s, i = self.n_state, self.n_state + self.n_inputs
        state, inputs, params = list(tensors[:s]), list(tensors[s:i]), list(tensors[i:])
        self.referenced = [j for j in self.referenced if not is_packed(tensors[j])]
        store_ledger = self.stats.storage_ledger
        stores = {"device": make_store("device", self.device, store_ledger)}
        try:
            stores["remote"] = make_store(self.storage, self.device, store_ledger, self.directory)
            ex = Executor(
                fn=self.fn,
                inputs=inputs,
                input_grad=list(needs[s:i]),
                params=params,
                device=self.device,
                stores=stores,
                remote_kind=self.storage,
                initial=state,
                initial_grad=list(needs[:s]),
                emit=self.reducer.emit if self.reducer is not None else None,
                cuda_devices=self.cuda_devices,
                pack_tape=self.pack_tape,
                ledger=self.stats.ledger,
            )
            self.executor = ex
            ex.run(self.schedule.forward)
            ex.end_forward()
        except BaseException:
            for store in stores.values():
                store.close()
            raise
        assert ex.current is not None
        outs = self.reducer.outputs() if self.reducer is not None else []
        self.n_outputs = len(outs)
        self._update_stats()
        return [t.detach() for t in outs] + [t.detach() for t in ex.current]

    def backward(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        ex = self.executor
        if ex is None or ex.closed:
            raise UsageError(
                "spikeckpt.scan: backward can run only once per forward (its checkpoints are "
                "freed as it goes)" + SECOND_BACKWARD
            )
        n = self.n_outputs
        y_grad = self.reducer.y_grad(grads[:n]) if self.reducer is not None else lambda t: ()
        try:
            ex.start_backward(grads[n:], y_grad)
            with self.backward_context():
                ex.run(self.schedule.backward)
            self.stats.completed = True
        finally:
            self._update_stats()
            ex.close()
        out = [*ex.grad_state, *ex.grad_inputs, *ex.grad_params]
        # handed over: autograd takes a gradient held nowhere else as the leaf's ``.grad``
        # (a full input's gradient was copied, one input's size more at the step's end)
        ex.grad_state, ex.grad_inputs, ex.grad_params = [], [], []
        return out

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()

    def _update_stats(self) -> None:
        ex = self.executor
        if ex is None:
            return
        c = ex.counters
        self.stats.forward_steps = c.forward_steps
        self.stats.backward_steps = c.backward_steps
        self.stats.tape_bytes_per_step = c.tape_bytes / c.taped_steps if c.taped_steps else 0.0


# ----------------------------------------------------------------------------- scan


@eager_under_compile
def scan(
    step: Callable[[Any, Any], tuple[Any, Any]],
    inputs: Tensor | Sequence[Any],
    state: Any,
    *,
    plan: Any,
    storage: Storage = "host",
    readout: Readout = None,
    params: Sequence[Tensor] | None = None,
    stats: bool = False,
    budget: int | str | None = None,
    directory: str | os.PathLike | None = None,
    pack_tape: bool = False,
    spikes: bool = False,
    steps: int | None = None,
) -> ScanResult | Any:
    """Run ``step`` over time with checkpointed memory; gradients equal the plain loop's.

    Args:
        step: pure ``step(state, x_t) -> (state, y_t)``; no hidden state, no in-place updates
            of its arguments. Randomness inside it is replayed exactly on recomputation.
        inputs: ``(T, ...)`` time-first tensor (``x_t = inputs[t]``), or a sequence of ``T``
            per-step inputs (tensors or pytrees of tensors; they are stacked). May live on the
            host while the state is on the device: each step's slice is moved. Or a packed
            spike train: a [`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain] (or a ``torch.sparse_coo``
            train, packed with [`as_spike_train`][spikeckpt.storage.spiketrain.as_spike_train]), on the host or on
            the device; each step is unpacked on the device when it runs (``x.step(t,
            device)``), so the dense train never exists whole. A packed train gets no
            gradient.
        state: initial state ``x_0``: a tensor, tuple, NamedTuple, dict or nested mix of tensors.
            Integer/bool leaves are carried without gradient. Initial states whose shape the
            first step sets are taken as they are: ``None`` leaves (Norse cells build their
            own state), empty tensors (snnTorch's ``init_leaky()``) and 0-d tensors (Norse's
            ``initial_state(x).v``): step 0 then runs first, taped as in the plain loop, and
            the checkpointed run starts from its state (``stats`` describe steps ``1..T-1``).
            Under ``torch.autocast``, and where an untaped step 0 returns a state leaf in
            another dtype (a half-precision snnTorch model: its float32 reset makes a
            float32 membrane), step 0 runs first too (unless ``plan`` is a ``Schedule`` for
            ``T`` steps): the state takes the dtypes step 0 returns, as in the plain loop.
        plan: a plan (``spikeckpt.plans.Uniform(50)``, ...), a ``Schedule`` for this ``T``, or
            ``"auto"`` (measures one step in the measuring room,
            [`probe_step`][spikeckpt.engine.measure.probe_step]: sizes, working bytes and operation
            times, and chooses the fastest plan whose step fits ``budget``,
            [`choose_step`][spikeckpt.plans.account.choose_step]). A plan built without intervals
            (``Double()``, ``Uniform()``, ``TwoLevel(s)``) gets them from the same
            measurements (`fill`). Measured once per step
            function, shapes, ``T``, tier and budget (a few dozen step evaluations).
        storage: where ``"remote"`` checkpoints go: ``"host"`` (CPU RAM), ``"disk"`` (files in
            a temporary folder under ``directory``) or ``"device"``.
        readout: ``None``: stacked outputs ``(T, ...)``; ``"sum"``, ``"mean"``, ``"last"``,
            ``"max"``, ``"min"``: reduced in the loop (O(1) memory; ``"max"`` is
            ``ys.max(0).values`` with its gradient, which goes to the first of tied maxima);
            or ``fold(acc, y_t, t) -> acc`` (``acc`` is ``None`` at ``t = 0``), which returns
            the last ``acc``.
        params: tensors whose gradients scan computes. Default: the parameters of every
            ``nn.Module`` reachable from ``step``: ``step`` itself, its bound ``self``, the
            variables it closes over, its default arguments, the globals it names,
            ``functools.partial`` arguments (recursively through functions it reaches),
            tensors requiring grad among them, and leaf tensors requiring grad held as
            attributes of those modules. Tensors the step reaches otherwise are not seen:
            scan raises [`UnlistedParamsError`][spikeckpt.errors.UnlistedParamsError] when the
            step uses any (pass them here).
        stats: deprecated: return the old triple ``(ys, final_state, stats)`` (with a
            ``DeprecationWarning``); the result's ``.stats`` holds them.
        budget: the peak device memory of the training step (bytes or a string like
            ``"2GiB"``): the inputs while they are on the device, the stacked outputs and their
            gradient, the parameters' ``.grad`` and the engine's gradient buffers, the plan's
            checkpoints (the host tier's too on a CPU run, where the host is the device: the
            stats' ``note`` says so) and tapes, one step's working memory
            ([`spikeckpt.plans.account`][spikeckpt.plans.account]). ``plan="auto"`` chooses within it; a plan given
            is checked against it. A [`BudgetTooSmall`][spikeckpt.errors.BudgetTooSmall] names a budget that
            works.
        directory: parent folder for the disk tier's files (default: the system temp folder);
            only with ``storage="disk"`` (`check_storage`).
        pack_tape: keep the exactly-binary tensors autograd saves in taped steps (spikes fed
            to a Linear layer) bit-packed or as index lists; gradients are unchanged. Off by
            default: scanning every saved tensor costs time (about +60% per step for a
            2x256 LIF net on CPU); turn it on when the tape, not the time, is the limit.
        spikes: the inputs must be spike trains (exactly 0 or 1); anything else raises
            [`NotBinaryError`][spikeckpt.errors.NotBinaryError] naming the value found.
        steps: a constant input: ``inputs`` is then *one* step's input (``(B, ...)``, or a
            pytree of tensors), fed to ``step`` at each of ``steps`` time steps, as a loop
            ``for t in range(steps): ... step(state, x)`` does (snnTorch tutorial 5's
            static image). No ``(T, B, ...)`` copy is made; an input that requires grad gets
            the gradient of every step, summed as the plain loop sums it.

    Returns:
        A [`ScanResult`][spikeckpt.engine.stats.ScanResult]: the pair ``(ys, final_state)`` (``ys, state =
        scan(...)``), with the run's [`ScanStats`][spikeckpt.engine.stats.ScanStats] in ``.stats``; ``ys`` has the
        structure of ``y_t`` with a leading ``T`` axis (``readout=None``) or the reduced
        value.
    """
    refuse_func_transforms()
    check_storage(storage, directory, probe=False)
    check_readout(readout)
    if budget is not None:  # read here, as wrap does: also when no gradient is taken
        budget = parse_bytes(budget)
    if steps is not None:
        step, inputs, params = _constant_input(step, inputs, steps, params)
        # one step's pytree expanded over time: its leaves are time-first (a tuple of them is
        # not a sequence of per-step inputs)
        flat, in_def = tree_flatten(inputs)
        timed: Timed = (flat, in_def, steps)
    else:
        timed = time_leaves(as_input(inputs))
    if spikes:
        for leaf in timed[0]:
            if not is_packed(leaf):
                require_binary(leaf, "scan inputs (spikes=True)")
    param_list = default_params(step, params, readout if callable(readout) else None)
    options = ScanOptions(plan, storage, readout, budget, directory, pack_tape)
    leaves = tree_flatten(state)[0]
    with uncached_parametrizations():  # each step computes its parametrized weights
        if unshaped(leaves) or _first_apart(step, state, plan, timed, leaves, param_list):
            ys, final, run_stats = _after_first_step(step, state, timed, param_list, options)
        else:
            ys, final, run_stats = _run(step, timed, state, param_list, options)
    return ScanResult(ys, final, run_stats).legacy(stats, "scan")


def _constant_input(
    step: Callable[[Any, Any], Any], x: Any, steps: Any, params: Sequence[Tensor] | None
) -> tuple[Callable[[Any, Any], Any], Any, Sequence[Tensor] | None]:
    """``scan(..., steps=n)``: ``(step', inputs', params')`` for one input ``x`` fed at every
    step. The inputs are ``x`` expanded to ``(n, ...)`` (a view: no copy), detached; when
    ``x`` has leaves that require grad, ``step'`` feeds ``x`` itself and those leaves join
    ``params``, so their gradient sums over the steps like a parameter's."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be a positive int (the number of time steps), got {steps!r}")
    if is_packed(x) or (isinstance(x, Tensor) and x.is_sparse):
        raise ConfigError(
            "steps= takes one dense step's input (B, ...) fed at every step; a packed spike "
            "train is a whole (T, B, ...) sequence: pass it without steps="
        )
    leaves = tree_leaves(x)
    if not leaves or not all(isinstance(leaf, Tensor) for leaf in leaves):
        raise ConfigTypeError(
            f"with steps=, inputs must be one step's input: a tensor or a pytree of tensors, "
            f"got {type(x).__name__}"
        )
    expanded = tree_map(lambda v: v.detach().expand(steps, *v.shape), x)
    learn = [leaf for leaf in leaves if leaf.requires_grad]
    if not learn:
        return step, expanded, params

    def constant_step(state: Any, x_t: Any) -> Any:
        return step(state, x)

    constant_step.__wrapped__ = step  # type: ignore[attr-defined]  # the plan cache's key
    if params is not None:
        params = [*params, *learn]
    return constant_step, expanded, params


#: ``id`` of the state a ``_scan_after_step0`` call passes on: shaped by step 0 already (its


def _first_apart(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    plan: Any,
    timed: Timed,
    leaves: list[Any],
    params: list[Tensor],
) -> bool:
    """Whether scan runs step 0 first because the step returns the state in another dtype
    than the initial state's: one untaped step 0 does change a dtype (`changes_dtype`: a
    half-precision model whose step computes its state in float32; under autocast, tried
    whatever the dtypes: a bf16 product can make a bf16 state leaf). The plain loop then
    carries the dtypes step 0 gives, and so does scan. Not with a ``Schedule`` built for
    ``T`` steps (it would not fit ``T - 1``). Not merely because autocast is on: a step 0
    run apart hands its state to the run as inputs of its Function, so autograd visits
    step 0's graph from every state leaf, also those the run gives no gradient; a custom
    Function there (a surrogate spike) turns that into zeros, and a parameter the plain
    loop leaves at ``.grad`` None got zeros (Norse Linear-LIFCell-CobaLIFCell)."""
    inputs, in_def, T = timed
    if isinstance(plan, Schedule) and plan.T == T:
        return False
    device = next(
        (t.device for t in (*leaves, *inputs) if isinstance(t, Tensor) or is_packed(t)), None
    )
    device = device if device is not None else torch.device("cpu")
    return changes_dtype(
        step,
        state,
        in_def.unflatten([step_of(x, 0, device) for x in inputs]),
        params,
        force=autocast_on(device),
    )


def _run(
    step: Callable[[Any, Any], tuple[Any, Any]],
    timed: Timed,
    state: Any,
    param_list: list[Tensor],
    options: ScanOptions,
) -> tuple[Any, Any, ScanStats]:
    """The run of ``scan`` from a state of full shape: ``(ys, final_state, stats)``."""
    in_leaves, in_def, T = timed
    state_leaves, state_def = tree_flatten(state)
    names = [f"state{n}" for n in state_def.names]
    refuse_non_tensor_leaves(state_leaves, names)
    for leaf in in_leaves:
        if leaf.shape[0] != T:
            raise ConfigError(f"all input leaves need the same T; got {leaf.shape[0]} and {T}")
    readout, storage = options.readout, options.storage
    device = next((t.device for t in (*state_leaves, *param_list, *in_leaves)), torch.device("cpu"))
    fold = readout if callable(readout) else None
    reducer = None if fold is not None else Reducer(readout, T)  # type: ignore[arg-type]
    fn = StepFn(step, state_def, state_leaves, in_def, fold, param_list)
    dense_inputs = [leaf for leaf in in_leaves if not is_packed(leaf)]
    need_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (*state_leaves, *dense_inputs, *param_list)
    )
    fn.unseen_check = torch.is_grad_enabled() and not need_grad
    if not need_grad:
        run_stats = ScanStats(plan="loop (no grad)", schedule=None, T=T, storage=storage)
        run_stats.state_bytes = leaf_bytes(state_leaves)
        with torch.no_grad():
            outs, final = _plain_loop(fn, state_leaves, in_leaves, reducer, T, device)
        run_stats.forward_steps = T
        return _finish(outs + final, len(outs), fn, state_def, fold, run_stats)
    started = time.perf_counter()
    schedule, account = _schedule(step, state, timed, param_list, options, device)
    planning = time.perf_counter() - started
    run_stats = ScanStats(
        plan=schedule.plan,
        schedule=schedule,
        T=T,
        storage=storage,
        predicted=simulate_cached(schedule),
        planned=account,
        note=tier_note(storage, device.type) if account is not None else None,
        planning_seconds=planning,
    )
    run_stats.state_bytes = leaf_bytes(state_leaves)
    job = _Job(
        fn,
        schedule,
        reducer,
        n_state=len(state_leaves),
        n_inputs=len(in_leaves),
        storage=storage,
        device=device,
        directory=options.directory,
        cuda=cuda_devices((*state_leaves, *dense_inputs, *param_list)),
        stats=run_stats,
        pack_tape=options.pack_tape,
    )
    recomputes = run_stats.predicted is not None and run_stats.predicted.forward_steps > T
    way = (
        "draw without generator= (seed with torch.manual_seed), or use "
        "plan=spikeckpt.plans.BPTT(), which does not recompute"
    )
    with no_own_draws(step if recomputes else None, f"spikeckpt.scan: {schedule.plan}", way):
        outs = run_job(job, [*state_leaves, *in_leaves, *param_list])
    return _finish(outs, job.n_outputs, fn, state_def, fold, run_stats)


def _schedule(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    timed: Timed,
    param_list: list[Tensor],
    options: ScanOptions,
    device: torch.device,
) -> tuple[Schedule, StepBytes | None]:
    """The schedule ``options.plan`` runs for these inputs, and the step it makes when it was
    planned for (or checked against) a budget."""
    in_leaves, _, T = timed
    plan, budget = options.plan, options.budget
    check_plan(plan, T, budget)
    if not needs_measuring(plan, budget):
        return schedule_of(plan, T), None
    key = (
        plan,
        budget,
        T,
        options.storage,
        options.pack_tape,
        options.apart,
        plan_key(step, tree_flatten(state)[0], in_leaves, param_list),
        grads_held(param_list),  # a held .grad counts beside the step's own sums
    )

    def measure() -> tuple[Any, StepBytes | None]:
        # the probes' draws from the step's own generators are put back (walked only when
        # a shape is measured, not at each call that finds its plan)
        with generators_kept(reachable_generators(step)):
            return measured_plan(step, state, timed, param_list, options, device)

    with tensor_hooks_held(param_list):  # the probes' gradients are not yours
        found, account = planned(key, measure)
    return schedule_of(found, T), account


def _after_first_step(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    timed: Timed,
    param_list: list[Tensor],
    options: ScanOptions,
) -> tuple[Any, Any, ScanStats]:
    """``scan`` from an initial state that step 0 shapes (`spikeckpt.engine.first_step`):
    step 0 runs as the plain loop does, then steps ``1..T-1`` run from its state; the stats
    describe those (a run of step 0 alone: ``plan="step 0 only"``)."""
    in_leaves, in_def, T = timed
    plan, readout = options.plan, options.readout
    if isinstance(plan, Schedule) and plan.T == T:
        raise ConfigError(
            f"the initial state has leaves that step 0 shapes (None, empty or 0-d), so step "
            f"0 runs before the checkpointed run, which has T-1={T - 1} steps: build the "
            "Schedule for T-1, or pass an initial state of full shape"
        )
    leaves = [t for t in tree_flatten(state)[0] if isinstance(t, Tensor)]
    device = next((t.device for t in (*leaves, *param_list, *in_leaves)), torch.device("cpu"))
    first = first_step(step, state, in_def.unflatten([step_of(x, 0, device) for x in in_leaves]))
    rest = ([drop_first(x) for x in in_leaves], in_def, T - 1) if T > 1 else None
    if readout is None or readout == "last" or (first.y is None and not callable(readout)):
        # (a step that outputs None reduces to None: nothing to carry)
        if rest is None:
            ys = first.y if readout == "last" else first.stacked(None)
            return ys, first.rebuild(first.state), _first_step_stats(T, options)
        inner = replace(options, apart=options.apart + 1)
        ys, final, run_stats = _run_rest(first.step, rest, first.state, param_list, inner)
        return (first.stacked(ys) if readout is None else ys), first.rebuild(final), run_stats
    carried_step, carry = first.carried(readout, device)
    run_stats = _first_step_stats(T, options)
    if rest is not None:
        inner = replace(options, readout=None, apart=options.apart + 1)
        _, carry, run_stats = _run_rest(carried_step, rest, carry, param_list, inner)
    acc = carry[1]
    if readout in ("sum", "mean"):
        acc = first.narrowed(tree_map(lambda a: a / T, acc) if readout == "mean" else acc)
    return acc, first.rebuild(carry[0]), run_stats


def _run_rest(
    step: Callable[[Any, Any], tuple[Any, Any]],
    timed: Timed,
    state: Any,
    param_list: list[Tensor],
    options: ScanOptions,
) -> tuple[Any, Any, ScanStats]:
    """The steps after those run apart, from their ``state``: the next runs apart too where
    it still changes a state leaf's dtype (`changes_dtype`; under autocast snnTorch's
    ``DeltaLeaky`` keeps the previous membrane, float32 until a step has made it bf16), up to
    `MAX_APART` steps in all; the rest are checkpointed."""
    in_leaves, in_def, T = timed
    if options.apart < MAX_APART and T > 1:
        leaves = [t for t in tree_flatten(state)[0] if isinstance(t, Tensor)]
        device = next((t.device for t in (*leaves, *param_list)), torch.device("cpu"))
        x0 = in_def.unflatten([step_of(x, 0, device) for x in in_leaves])
        if changes_dtype(step, state, x0, param_list):
            return _after_first_step(step, state, timed, param_list, options)
    return _run(step, timed, state, param_list, options)


def _first_step_stats(T: int, options: ScanOptions) -> ScanStats:
    """Stats of a run that was step 0 alone (T=1 from a state step 0 shapes)."""
    run_stats = ScanStats(plan="step 0 only", schedule=None, T=T, storage=options.storage)
    run_stats.forward_steps = 1
    run_stats.backward_steps = 0
    return run_stats


def _plain_loop(
    fn: StepFn,
    state: list[Tensor],
    inputs: list[Tensor],
    reducer: Reducer | None,
    T: int,
    device: torch.device,
) -> tuple[list[Tensor], list[Tensor]]:
    """The no-grad path: a plain loop, no storage. Returns (readout outputs, final leaves)."""
    leaves = state
    for t in range(T):
        xs = [step_of(leaf, t, device) for leaf in inputs]
        leaves, ys = fn(t, leaves, xs, True)
        if reducer is not None:
            reducer.emit(t, ys)
    outs = reducer.outputs() if reducer is not None else []
    return outs, leaves


def _finish(
    outs: list[Tensor],
    n_out: int,
    fn: StepFn,
    state_def: TreeDef,
    fold: Any,
    run_stats: ScanStats,
) -> tuple[Any, Any, ScanStats]:
    ys_leaves, final = outs[:n_out], outs[n_out:]
    n = state_def.count
    final_state = state_def.unflatten(final[:n])
    if fold is not None:
        assert fn.acc_def is not None
        ys = fn.acc_def.unflatten(final[n:])
    else:
        assert fn.y_def is not None
        ys = (
            None if fn.y_def.count == 0 and fn.y_def.spec is None else fn.y_def.unflatten(ys_leaves)
        )
    return ys, final_state, run_stats
