"""``spikeckpt.scan``: run a step function over time with a checkpointing plan and exact gradients.

``scan`` wraps the whole time loop in one custom `torch.autograd.Function`. Its forward
runs the schedule's forward phase (untaped steps, stores, and the taped segments a plan keeps
from the forward pass); its backward runs the backward phase (loads, recomputation,
backpropagation of each taped segment with `torch.autograd.grad`, carrying the state
gradient and accumulating parameter and input gradients). See
`spikeckpt.engine.executor` for the memory ledger convention.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, Literal

import torch
from torch import Tensor, nn

from spikeckpt.engine.executor import Executor
from spikeckpt.engine.function import Job, run_job
from spikeckpt.engine.grad import unseen_leaves
from spikeckpt.engine.packed import as_input, drop_first, is_packed, step_of
from spikeckpt.engine.phase import recomputing
from spikeckpt.engine.readout import Readout, ReadoutFn, Reducer, check_readout, take_extremum
from spikeckpt.engine.rng import cuda_devices
from spikeckpt.engine.saved import backward_reserve, measure_step
from spikeckpt.engine.stats import ScanStats
from spikeckpt.engine.timing import measure_costs
from spikeckpt.engine.tree import TreeDef, leaf_bytes, tree_flatten
from spikeckpt.errors import UnlistedParamsError
from spikeckpt.plans.schedule import Schedule
from spikeckpt.plans.simulate import Cost, CostModel, simulate
from spikeckpt.storage.codecs import require_binary
from spikeckpt.storage.tiers import check_storage, make_store

__all__ = ["ScanStats", "scan"]

Storage = Literal["device", "host", "disk"]


# ----------------------------------------------------------------------------- step wrapper


class _StepFn:
    """The user's step on flat leaves: ``(t, leaves, x_leaves, check) -> (leaves, y_leaves)``.

    With ``check`` it validates the returned structure, shapes and dtypes against ``x_0``. A
    callable readout ``fold(acc, y_t, t)`` is carried as extra state leaves (``acc`` is ``None``
    at ``t = 0``), so its gradient flows like the state's.
    """

    def __init__(
        self,
        step: Callable[[Any, Any], Any],
        state_def: TreeDef,
        state0: list[Tensor],
        in_def: TreeDef,
        fold: ReadoutFn | None,
        params: list[Tensor],
    ) -> None:
        self.step = step
        self.state_def = state_def
        self.meta = [(t.shape, t.dtype, t.device) for t in state0]
        self.names = [f"state{n}" for n in state_def.names]
        self.in_def = in_def
        self.fold = fold
        self.n = state_def.count
        self.y_def: TreeDef | None = None
        self.y_meta: list[tuple[torch.Size, torch.dtype]] = []
        self.acc_def: TreeDef | None = None
        self.params = params
        self.scanned_closures = False
        #: scan takes its no-grad path while grad mode is on (nothing it sees requires grad):
        #: step 0 then looks for tensors requiring grad that the step reaches unseen
        self.unseen_check = False

    def _flat_y(self, t: int, y: Any, check: bool) -> list[Tensor]:
        if y is None and (self.y_def is None or self.y_def.count == 0):
            if self.y_def is None:
                self.y_def = TreeDef("pytree", None, None, 0, [])
            return []
        if self.y_def is None:
            leaves, self.y_def = tree_flatten(y)
            for name, leaf in zip(self.y_def.names, leaves, strict=False):
                if not isinstance(leaf, Tensor):
                    raise TypeError(f"step output y{name} is {type(leaf).__name__}, not a tensor")
            self.y_meta = [(leaf.shape, leaf.dtype) for leaf in leaves]
            return leaves
        leaves = self.y_def.flatten(y) if y is not None else None
        if leaves is None:
            raise ValueError(
                f"step {t} returned an output y with another structure than step 0 "
                f"(expected {self.y_def.describe()})"
            )
        if check:
            for name, leaf, (shape, dtype) in zip(
                self.y_def.names, leaves, self.y_meta, strict=False
            ):
                if leaf.shape != shape or leaf.dtype != dtype:
                    raise ValueError(
                        f"step {t} returned output y{name} of shape {tuple(leaf.shape)} and "
                        f"dtype {leaf.dtype}; step 0 gave {tuple(shape)}, {dtype}"
                    )
        return leaves

    def __call__(
        self, t: int, leaves: list[Tensor], xs: list[Tensor], check: bool
    ) -> tuple[list[Tensor], list[Tensor]]:
        n = self.n
        user = leaves[:n] if self.fold is not None else leaves
        if check and t == 0 and self.unseen_check:
            # the no-grad path while grad is on: nothing scan sees requires grad. Run step 0
            # with grad to find tensors requiring grad that the step reaches unseen.
            with torch.enable_grad():
                out = self.step(self.state_def.unflatten(user), self.in_def.unflatten(xs))
            if isinstance(out, tuple) and len(out) == 2:
                self._warn_closures(user, xs, tree_flatten(out)[0], no_grad_path=True)
                out = torch.utils._pytree.tree_map(
                    lambda v: v.detach() if isinstance(v, Tensor) else v, out
                )
        else:
            out = self.step(self.state_def.unflatten(user), self.in_def.unflatten(xs))
        if check and not (isinstance(out, tuple) and len(out) == 2):
            got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
            raise TypeError(f"step must return a 2-tuple (state, y_t); step {t} returned {got}")
        new_state, y = out
        new = self.state_def.flatten(new_state)
        if new is None:
            raise ValueError(
                f"step {t} returned a state that is not {self.state_def.describe()} like the "
                f"initial state (got {type(new_state).__name__}); the state structure must not "
                "change between steps"
            )
        if check:
            self._check_state(t, new)
            if not self.scanned_closures and torch.is_grad_enabled():
                self._warn_closures(user, xs, new)
        ys = self._flat_y(t, y, check)
        if self.fold is None:
            return new, ys
        acc = None if t == 0 else self.acc_def.unflatten(leaves[n:])  # type: ignore[union-attr]
        acc = self.fold(acc, y, t)
        if self.acc_def is None:
            acc_leaves, self.acc_def = tree_flatten(acc)
            if not all(isinstance(a, Tensor) for a in acc_leaves):
                raise TypeError("a callable readout must return a tensor or a pytree of tensors")
            return new + acc_leaves, []
        acc_leaves = self.acc_def.flatten(acc)
        if acc_leaves is None:
            raise ValueError(f"the readout returned another structure at step {t}")
        return new + acc_leaves, []

    def _check_state(self, t: int, new: list[Any]) -> None:
        for name, leaf, (shape, dtype, device) in zip(self.names, new, self.meta, strict=False):
            if not isinstance(leaf, Tensor):
                raise TypeError(f"step {t} returned {name} = {type(leaf).__name__}, not a tensor")
            if leaf.shape != shape or leaf.dtype != dtype or leaf.device != device:
                raise ValueError(
                    f"step {t} changed {name}: it is {tuple(leaf.shape)} {leaf.dtype} on "
                    f"{leaf.device}, the initial state's is {tuple(shape)} {dtype} on {device}; "
                    "the state's shapes and dtypes must stay the same at every step"
                    + (
                        " (under torch.autocast scan takes the dtypes step 0 returns, unless "
                        "the plan is a Schedule built for all T steps: build it for T-1)"
                        if leaf.dtype != dtype and t == 0
                        else ""
                    )
                )

    def _warn_closures(
        self,
        user: list[Tensor],
        xs: list[Tensor],
        new: list[Any],
        *,
        no_grad_path: bool = False,
    ) -> None:
        """Raise [`UnlistedParamsError`][spikeckpt.errors.UnlistedParamsError] if the step uses leaf tensors
        requiring grad that are not in ``params`` (they would get no gradient).

        ``no_grad_path``: scan saw nothing requiring grad and would run without a tape.
        """
        if any(isinstance(t, Tensor) and t.grad_fn is not None for t in user):
            return  # only walk the graph of a step that starts from fresh leaves
        self.scanned_closures = True
        known = [*self.params, *user, *xs, *(x._base for x in xs if x._base is not None)]
        found = unseen_leaves(new, known)
        if not found:
            return
        shapes = ", ".join(f"{tuple(v.shape)} {v.dtype}" for v in found[:5])
        where = (
            "nothing scan sees requires grad, so it would run without gradients and backward() "
            "would fail, but the step"
            if no_grad_path
            else "the step"
        )
        raise UnlistedParamsError(
            f"scan: {where} uses {len(found)} tensor(s) requiring grad that are not in "
            f"`params` (shapes {shapes}); they would get no gradient. Pass them with "
            "scan(..., params=[*your_params, tensor, ...]), or from spikeckpt.wrap with "
            "wrap(model, ..., params=[tensor, ...]) (found by default: parameters of modules "
            "reachable from the step's self, closure, defaults and globals, and leaf tensors "
            "requiring grad held as attributes of those modules; registering the tensor as an "
            "nn.Parameter also works).",
            found,
        )


# ----------------------------------------------------------------------------- the Function


class _Job(Job):
    """The schedule executor's run as a `Job`.

    Function inputs: (*initial state leaves, *input leaves, *params); outputs:
    (*readout outputs, *final state leaves).
    """

    def __init__(
        self,
        fn: _StepFn,
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
            raise RuntimeError(
                "spikeckpt.scan: backward can run only once per forward (its checkpoints are "
                "freed as it goes); run scan again for another backward"
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
        return [*ex.grad_state, *ex.grad_inputs, *ex.grad_params]

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


# ----------------------------------------------------------------------------- helpers


def _time_leaves(inputs: Any) -> tuple[list[Tensor], TreeDef, int]:
    """Time-first input leaves ``(T, ...)``, the per-step structure, and ``T``."""
    if is_packed(inputs):  # a packed train: one leaf, unpacked step by step
        if inputs.T == 0:
            raise ValueError("inputs hold T=0 time steps; scan needs T >= 1")
        return [inputs], TreeDef("tensor", None, None, 1, [""]), inputs.T
    if isinstance(inputs, Tensor):
        if inputs.dim() == 0:
            raise ValueError("inputs must have a leading time dimension (T, ...); got a 0-d tensor")
        if inputs.shape[0] == 0:
            raise ValueError("inputs hold T=0 time steps; scan needs T >= 1")
        return [inputs], TreeDef("tensor", None, None, 1, [""]), inputs.shape[0]
    if isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)):
        if len(inputs) == 0:
            raise ValueError("inputs hold T=0 time steps; scan needs T >= 1")
        first, in_def = tree_flatten(inputs[0])
        columns: list[list[Tensor]] = [[] for _ in first]
        for t, item in enumerate(inputs):
            leaves = in_def.flatten(item)
            if leaves is None or not all(isinstance(x, Tensor) for x in leaves):
                raise TypeError(f"per-step input {t} is not {in_def.describe()} like input 0")
            for column, leaf in zip(columns, leaves, strict=False):
                column.append(leaf)
        return [torch.stack(column) for column in columns], in_def, len(inputs)
    raise TypeError(
        f"inputs must be a time-first tensor (T, ...) or a sequence of per-step inputs, "
        f"got {type(inputs).__name__}"
    )


def _default_params(step: Any, params: Any) -> list[Tensor]:
    reachable, modules = _reachable(step)
    _guard_running_stats(modules)
    if params is None:
        params = reachable
    unique: dict[int, Tensor] = {}
    for p in params:
        if not isinstance(p, Tensor):
            raise TypeError(f"params must be tensors, got {type(p).__name__}")
        if p.requires_grad:
            unique.setdefault(id(p), p)
    return list(unique.values())


def _code_globals(code: Any) -> list[str]:
    """Global names a code object (and the code objects nested in it) loads."""
    names = list(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names.extend(_code_globals(const))
    return names


def _reachable(step: Any) -> tuple[list[Tensor], list[nn.Module]]:
    """Tensors requiring grad reachable from ``step``: parameters of the modules it is, is
    bound to, closes over, takes as defaults or ``partial`` arguments, or names as globals
    (through the functions and containers it reaches, a few levels deep), tensors requiring
    grad among those, leaf tensors requiring grad held as attributes of those modules (a neuron's
    ``self.beta = torch.full(..., requires_grad=True)``) or in their NamedTuple attributes
    (Norse keeps neuron parameters in ``module.p``); and the modules reached (submodules
    included)."""
    import functools
    import inspect
    import types

    found: dict[int, Tensor] = {}
    seen: set[int] = set()
    modules: dict[int, nn.Module] = {}

    def add(t: Tensor) -> None:
        if t.requires_grad:
            found.setdefault(id(t), t)

    def visit(obj: Any, depth: int) -> None:
        if depth > 4 or id(obj) in seen or isinstance(obj, (types.ModuleType, type, str)):
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            add(obj)
        elif isinstance(obj, nn.Module):
            for p in obj.parameters():
                add(p)
            for m in obj.modules():
                modules.setdefault(id(m), m)
                for value in vars(m).values():
                    if isinstance(value, tuple):
                        visit(value, depth + 1)
                    elif isinstance(value, Tensor) and value.is_leaf:
                        add(value)  # a tensor attribute, e.g. self.beta = torch.full(...)
        elif isinstance(obj, functools.partial):
            for item in (obj.func, *obj.args, *obj.keywords.values()):
                visit(item, depth + 1)
        elif inspect.ismethod(obj):
            visit(obj.__self__, depth + 1)
            visit(obj.__func__, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in list(obj)[:1000]:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            for item in list(obj.values())[:1000]:
                visit(item, depth + 1)
        elif inspect.isfunction(obj):
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    visit(cell.cell_contents, depth + 1)
            for item in (*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()):
                visit(item, depth + 1)
            scope = obj.__globals__
            for name in dict.fromkeys(_code_globals(obj.__code__)):
                if name in scope:
                    visit(scope[name], depth + 1)
        elif callable(obj) and hasattr(obj, "__dict__") and not inspect.isbuiltin(obj):
            for item in list(vars(obj).values())[:100]:
                visit(item, depth + 1)

    visit(step, 0)
    return list(found.values()), list(modules.values())


_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
_RUNNING_STATS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def _guard_running_stats(modules: Sequence[nn.Module]) -> None:
    """Give every BatchNorm/InstanceNorm layer the step reaches a pair of forward hooks (once)
    that keep its running statistics out of recomputed calls: while the engine recomputes
    (`recomputing`), a training-mode call runs with its
    statistics buffers set aside, so they are updated once per step, in the forward phase, as
    in the plain loop. The outputs are unchanged: training mode normalises with the batch's own
    statistics."""
    for m in modules:
        if isinstance(m, _RUNNING_STATS) and not m.__dict__.get("_spikeckpt_guarded", False):
            m.register_forward_pre_hook(_stats_aside)
            m.register_forward_hook(_stats_back, always_call=True)
            m.__dict__["_spikeckpt_guarded"] = True


def _stats_aside(module: nn.Module, args: Any) -> None:
    """Forward pre-hook: while recomputing, a training-mode call does not update the running
    statistics (BatchNorm: ``track_running_stats`` off; InstanceNorm: buffers set aside)."""
    kept: dict[str, Any] | None = None
    if recomputing() and module.training and getattr(module, "track_running_stats", False):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            kept = {"track_running_stats": True}
            module.track_running_stats = False
        else:
            kept = {
                k: module._buffers[k] for k in _STAT_BUFFERS if module._buffers.get(k) is not None
            }
            for k in kept:
                module._buffers[k] = None
    module.__dict__.setdefault("_spikeckpt_kept", []).append(kept)


def _stats_back(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook (always called): put back what `_stats_aside` set aside."""
    stack = module.__dict__.get("_spikeckpt_kept")
    kept = stack.pop() if stack else None
    if kept and "track_running_stats" in kept:
        module.track_running_stats = True
    elif kept:
        module._buffers.update(kept)


def _resolve_schedule(
    plan: Any,
    T: int,
    measure: Callable[[], tuple[int, int]],
    budget: int | str | None,
    storage: str,
    timings: Callable[[], CostModel] | None = None,
    measured: Any = None,
    reserve: Callable[[int], int] = lambda S: 0,
) -> Schedule:
    """The schedule to run. ``"auto"`` and plans that leave their intervals open
    (`spikeckpt.plans.intervals.needs_intervals`) are planned from ``measure()``
    (``S``, ``A``) and ``timings()`` (the measured operation times), once per ``measured``
    key (the step, shapes and tier: see `_plan_key`; None: every time); ``"auto"``
    keeps ``reserve(S)`` bytes of the budget for the gradients."""
    if isinstance(plan, Schedule):
        if plan.T != T:
            raise ValueError(f"the schedule is for T={plan.T} steps but the inputs have T={T}")
        return plan
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"plan must be a plan object, a Schedule or 'auto', got {plan!r}")
        if budget is None:
            raise ValueError("plan='auto' needs a device memory budget: scan(..., budget='2GiB')")
    from spikeckpt.plans.intervals import fill, needs_intervals

    if isinstance(plan, str) or needs_intervals(plan):
        planned_key = None if measured is None else (plan, budget, T, storage, measured)
        with _CACHE_LOCK:
            planned = _PLANNED.get(planned_key) if planned_key is not None else None
        if planned is None:
            S, A = measure()
            costs = timings() if timings is not None else None
            if isinstance(plan, str):
                planned = _choose(T, S, max(A, 1), budget, storage, costs, reserve(S))
            else:
                planned = fill(
                    plan, T, state_bytes=S, step_bytes=A, costs=costs, remote=storage != "device"
                )
            if planned_key is not None:
                _remember(_PLANNED, planned_key, planned)
        plan = planned
    if not hasattr(plan, "schedule"):
        raise TypeError(f"plan must have a .schedule(T) method, got {type(plan).__name__}")
    key = _cache_key(plan, T)
    if key is not None:
        with _CACHE_LOCK:
            cached = _SCHEDULES.get(key)
            if cached is not None:
                _SCHEDULES.move_to_end(key)
                return cached
    if hasattr(plan, "for_length"):
        plan = plan.for_length(T)
    schedule = plan.schedule(T)
    if key is not None and isinstance(schedule, Schedule):
        _remember(_SCHEDULES, key, schedule)
    return schedule


def _choose(
    T: int,
    S: int,
    A: int,
    budget: int | str | None,
    storage: str,
    costs: CostModel | None,
    reserve: int,
) -> Any:
    """``plans.choose`` for ``budget`` less ``reserve`` (the gradients' bytes: the budget
    bounds the whole backward pass, not only checkpoints and tapes)."""
    from spikeckpt.errors import BudgetTooSmall
    from spikeckpt.plans import choose, minimum_budget
    from spikeckpt.units import format_bytes, parse_bytes

    total = parse_bytes(budget)  # type: ignore[arg-type]
    try:
        return choose(T, S, A, max(total - reserve, 1), remote=storage != "device", costs=costs)
    except BudgetTooSmall:
        smallest = minimum_budget(T, S, A) + reserve
        raise BudgetTooSmall(
            f"no checkpointing plan fits a device budget of {total} bytes ({format_bytes(total)})"
            f" for T={T} steps with a state of {S} bytes, {A} bytes taped per step and "
            f"{reserve} bytes for the gradients; the smallest budget that fits is {smallest} "
            f"bytes ({format_bytes(smallest)}). Raise the budget, shorten the sequence or "
            "shrink the batch.",
            budget_bytes=total,
            minimum_bytes=smallest,
        ) from None


def _plan_key(
    step: Any, leaves: Sequence[Tensor], inputs: Sequence[Tensor], params: Sequence[Tensor]
) -> Any:
    """What a plan filled from measurements depends on: the step's code and the shapes,
    dtypes and devices of the state, the per-step inputs and the parameters (so a training
    loop that builds a new closure or bound method per call still hits the cache)."""
    step = getattr(step, "__wrapped__", step)  # scan(..., steps=n) wraps the user's step
    owner = getattr(step, "__self__", None)
    func = getattr(step, "__func__", step)
    code = getattr(func, "__code__", None) or type(step)
    where = type(owner) if owner is not None else None
    shapes = tuple((tuple(t.shape), t.dtype, t.device.type) for t in (*leaves, *params)) + tuple(
        (tuple(leaf.shape[1:]), leaf.dtype, leaf.device.type) for leaf in inputs
    )
    return (code, where, shapes)


# Training calls scan with the same plan and T at every iteration: building a long schedule
# (Revolve on 4,000 steps: about 24,000 actions, 0.09 s) and simulating it (0.06 s) each time
# is wasted work. Schedules are immutable and a Plan is a value (equality and hash over its
# attributes), so both are kept in small LRU caches: schedules by (plan, T), simulator results
# by schedule identity.
_CACHE_SIZE = 16
_CACHE_LOCK = threading.Lock()
_SCHEDULES: OrderedDict[Any, Schedule] = OrderedDict()
_COSTS: OrderedDict[int, tuple[Schedule, Cost]] = OrderedDict()
# plans chosen from measurements ("auto", intervals left open), by _resolve_schedule's key
_PLANNED: OrderedDict[Any, Any] = OrderedDict()


def _cache_key(plan: Any, T: int) -> tuple[Any, int] | None:
    """``(plan, T)`` for plans hashed by value (`spikeckpt.plans.base.Plan`), else None."""
    from spikeckpt.plans.base import Plan

    if not isinstance(plan, Plan) or type(plan).__hash__ is not Plan.__hash__:
        return None  # identity-hashed or custom plans may change under the same key
    try:
        hash(plan)
    except TypeError:  # an unhashable attribute
        return None
    return plan, T


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    with _CACHE_LOCK:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)


def _simulate_cached(schedule: Schedule) -> Cost:
    """``simulate(schedule)`` (validates it; raises ``ScheduleError``), once per schedule."""
    with _CACHE_LOCK:
        cached = _COSTS.get(id(schedule))
    if cached is not None and cached[0] is schedule:
        return cached[1]
    cost = simulate(schedule)
    _remember(_COSTS, id(schedule), (schedule, cost))
    return cost


def _plain_loop(
    fn: _StepFn,
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


# ----------------------------------------------------------------------------- scan


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
) -> Any:
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
            Under ``torch.autocast`` step 0 runs first too (unless ``plan`` is a
            ``Schedule`` for ``T`` steps): the state takes the dtypes step 0 returns (a
            float32 membrane from a bf16 input, in snnTorch), as in the plain loop.
        plan: a plan (``spikeckpt.plans.Uniform(50)``, ...), a ``Schedule`` for this ``T``, or
            ``"auto"`` (measures one step for ``S``/``A`` and the step's operation times, and
            calls ``plans.choose`` with ``budget`` less the gradients' share:
            `backward_reserve`). A plan built without intervals
            (``Double()``, ``Uniform()``, ``TwoLevel(s)``) gets them from the same
            measurements (`spikeckpt.plans.intervals.fill`). Both are measured once
            per step function, shapes, ``T`` and tier (a few dozen step evaluations).
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
            scan raises [`UnlistedParamsError`][spikeckpt.errors.UnlistedParamsError] when the step uses
            any (pass them here).
        stats: also return a [`ScanStats`][spikeckpt.engine.stats.ScanStats].
        budget: device memory budget for ``plan="auto"`` (bytes or a string like ``"2GiB"``):
            checkpoints, tapes and the gradients the backward pass holds.
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
        ``(ys, final_state)`` or ``(ys, final_state, stats)``; ``ys`` has the structure of
        ``y_t`` with a leading ``T`` axis (``readout=None``) or the reduced value.
    """
    check_storage(storage, directory, probe=False)
    check_readout(readout)
    if steps is not None:
        step, inputs, params = _constant_input(step, inputs, steps, params)
    inputs = as_input(inputs)
    in_leaves, in_def, T = _time_leaves(inputs)
    state_leaves, state_def = tree_flatten(state)
    if (_unshaped(state_leaves) or _autocast_first(plan, T, state_leaves, in_leaves)) and (
        _SHAPED.get() != id(state)
    ):
        return _scan_after_step0(
            step,
            inputs,
            state,
            (in_leaves, in_def, T),
            plan=plan,
            storage=storage,
            readout=readout,
            params=params,
            stats=stats,
            budget=budget,
            directory=directory,
            pack_tape=pack_tape,
            spikes=spikes,
        )
    names = [f"state{n}" for n in state_def.names]
    for name, leaf in zip(names, state_leaves, strict=False):
        if not isinstance(leaf, Tensor):
            raise TypeError(f"every state leaf must be a tensor; {name} is {type(leaf).__name__}")
    for leaf in in_leaves:
        if leaf.shape[0] != T:
            raise ValueError(f"all input leaves need the same T; got {leaf.shape[0]} and {T}")
        if spikes and not is_packed(leaf):
            require_binary(leaf, "scan inputs (spikes=True)")
    param_list = _default_params(step, params)
    device = next((t.device for t in (*state_leaves, *param_list, *in_leaves)), torch.device("cpu"))
    fold = readout if callable(readout) else None
    reducer = None if fold is not None else Reducer(readout, T)  # type: ignore[arg-type]
    fn = _StepFn(step, state_def, state_leaves, in_def, fold, param_list)
    dense_inputs = [leaf for leaf in in_leaves if not is_packed(leaf)]
    cuda = cuda_devices((*state_leaves, *dense_inputs, *param_list))
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
        return _finish(outs + final, len(outs), fn, state_def, fold, run_stats if stats else None)

    def measure() -> tuple[int, int]:
        x0 = in_def.unflatten([step_of(leaf, 0, device) for leaf in in_leaves])
        # input slices on the device are views of the inputs: no memory of the tape's
        local = [leaf for leaf in in_leaves if not is_packed(leaf) and leaf.device == device]
        sizes = measure_step(step, state, x0, [*param_list, *local], pack=pack_tape)
        return sizes.state_bytes, sizes.step_bytes

    def timings() -> CostModel:
        return measure_costs(
            step, state_def, state_leaves, in_def, in_leaves, param_list,
            storage=storage, device=device, directory=directory,
        )  # fmt: skip

    key = (_plan_key(step, state_leaves, in_leaves, param_list), pack_tape)
    schedule = _resolve_schedule(
        plan, T, measure, budget, storage, timings, key,
        lambda S: backward_reserve(param_list, S),
    )  # fmt: skip
    predicted = _simulate_cached(schedule)
    run_stats = ScanStats(
        plan=schedule.plan, schedule=schedule, T=T, storage=storage, predicted=predicted
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
        directory=directory,
        cuda=cuda,
        stats=run_stats,
        pack_tape=pack_tape,
    )
    outs = run_job(job, [*state_leaves, *in_leaves, *param_list])
    return _finish(outs, job.n_outputs, fn, state_def, fold, run_stats if stats else None)


def _constant_input(
    step: Callable[[Any, Any], Any], x: Any, steps: Any, params: Sequence[Tensor] | None
) -> tuple[Callable[[Any, Any], Any], Any, Sequence[Tensor] | None]:
    """``scan(..., steps=n)``: ``(step', inputs', params')`` for one input ``x`` fed at every
    step. The inputs are ``x`` expanded to ``(n, ...)`` (a view: no copy), detached; when
    ``x`` has leaves that require grad, ``step'`` feeds ``x`` itself and those leaves join
    ``params``, so their gradient sums over the steps like a parameter's."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int (the number of time steps), got {steps!r}")
    if is_packed(x) or (isinstance(x, Tensor) and x.is_sparse):
        raise ValueError(
            "steps= takes one dense step's input (B, ...) fed at every step; a packed spike "
            "train is a whole (T, B, ...) sequence: pass it without steps="
        )
    tree = torch.utils._pytree
    leaves = tree.tree_leaves(x)
    if not leaves or not all(isinstance(leaf, Tensor) for leaf in leaves):
        raise TypeError(
            f"with steps=, inputs must be one step's input: a tensor or a pytree of tensors, "
            f"got {type(x).__name__}"
        )
    expanded = tree.tree_map(lambda v: v.detach().expand(steps, *v.shape), x)
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
#: 0-d leaves stay 0-d), so that scan runs it as it is
_SHAPED: ContextVar[int] = ContextVar("spikeckpt_shaped_state", default=-1)


def _unshaped(leaves: list[Any]) -> bool:
    """Whether the initial state has leaves whose shape the first step sets: ``None``, empty
    tensors (snnTorch's ``init_leaky()``) or 0-d tensors (Norse's ``initial_state(x).v``)."""
    return any(
        t is None or (isinstance(t, Tensor) and (t.dim() == 0 or t.numel() == 0)) for t in leaves
    )


def _autocast_first(plan: Any, T: int, state: list[Any], inputs: list[Any]) -> bool:
    """Whether scan runs step 0 first because autocast is on (the step may return the state in
    another dtype than the initial state's, as snnTorch's neurons do: a float32 membrane from
    a bf16 input): the plain loop then carries the dtypes step 0 gives, and so does scan.
    Not with a ``Schedule`` built for ``T`` steps (it would not fit ``T - 1``)."""
    if isinstance(plan, Schedule) and plan.T == T:
        return False
    device = next(
        (t.device for t in (*state, *inputs) if isinstance(t, Tensor) or is_packed(t)), None
    )
    kinds = {"cpu", device.type if device is not None else "cpu"}
    return any(torch.is_autocast_enabled(kind) for kind in kinds)


def _scan_after_step0(
    step: Callable[[Any, Any], tuple[Any, Any]],
    inputs: Any,
    state: Any,
    timed: tuple[list[Tensor], TreeDef, int],
    *,
    plan: Any,
    readout: Readout,
    params: Sequence[Tensor] | None,
    stats: bool,
    **kwargs: Any,
) -> Any:
    """``scan`` from an initial state that step 0 shapes: run step 0 as the plain loop does
    (taped, so gradients reach the initial state and everything step 0 used), then scan steps
    ``1..T-1`` from its state. Outputs are those of the plain loop, bitwise: ``readout=None``
    prepends ``y_0``; ``"sum"``/``"mean"`` and a callable fold start their accumulator at
    step 0 and carry it as state, so the additions happen in the loop's order."""
    in_leaves, in_def, T = timed
    param_list = _default_params(step, params)
    leaves = [t for t in tree_flatten(state)[0] if isinstance(t, Tensor)]
    device = next((t.device for t in (*leaves, *param_list, *in_leaves)), torch.device("cpu"))
    if kwargs.get("spikes"):
        for leaf in in_leaves:
            if not is_packed(leaf):
                require_binary(leaf, "scan inputs (spikes=True)")
    if isinstance(plan, Schedule) and plan.T == T:
        raise ValueError(
            f"the initial state has leaves that step 0 shapes (None, empty or 0-d), so step "
            f"0 runs before the checkpointed run, which has T-1={T - 1} steps: build the "
            "Schedule for T-1, or pass an initial state of full shape"
        )
    x0 = in_def.unflatten([step_of(leaf, 0, device) for leaf in in_leaves])
    state1, y0 = step(state, x0)
    step, state1, rebuild = _without_none_leaves(step, state1)
    rest = drop_first(inputs)
    run_stats: ScanStats | None = None
    tree_map = torch.utils._pytree.tree_map
    if readout is None or readout == "last":
        if T == 1:
            ys, final = (
                (y0 if readout == "last" else tree_map(lambda y: y.unsqueeze(0), y0)),
                rebuild(state1),
            )
        else:
            out = _scan_shaped(
                step,
                rest,
                state1,
                plan=plan,
                readout=readout,
                params=param_list,
                stats=stats,
                **kwargs,
            )
            ys, final = out[0], rebuild(out[1])
            run_stats = out[2] if stats else None
            if readout is None:
                ys = (
                    None
                    if y0 is None
                    else tree_map(lambda a, b: torch.cat([a.unsqueeze(0), b]), y0, ys)
                )
        return (ys, final, run_stats or _first_step_stats(T, kwargs)) if stats else (ys, final)
    if callable(readout):
        fold = readout
        acc0 = fold(None, y0, 0)
        t0: Any = torch.ones((), dtype=torch.int64, device=device)

        def fold_step(carry: Any, x_t: Any) -> tuple[Any, None]:
            s, acc, t = carry
            s, y = step(s, x_t)
            return (s, fold(acc, y, int(t)), t + 1), None

        carry0: Any = (state1, acc0, t0)
    elif readout in ("max", "min"):  # max(0)'s value and gradient (to the first of ties)
        acc0 = y0
        kind = readout

        def fold_step(carry: Any, x_t: Any) -> tuple[Any, None]:
            s, acc = carry
            s, y = step(s, x_t)
            return (
                s,
                tree_map(lambda a, b: torch.where(take_extremum(kind, b, a), b, a), acc, y),
            ), None

        carry0 = (state1, acc0)
    else:  # "sum" / "mean": the reducer's order, y_0 + y_1 + ...
        acc0 = y0

        def fold_step(carry: Any, x_t: Any) -> tuple[Any, None]:
            s, acc = carry
            s, y = step(s, x_t)
            return (s, tree_map(lambda a, b: a + b, acc, y)), None

        carry0 = (state1, acc0)
    if T == 1:
        final_carry = carry0
    else:
        out = _scan_shaped(
            fold_step,
            rest,
            carry0,
            plan=plan,
            readout=None,
            params=param_list,
            stats=stats,
            **kwargs,
        )
        final_carry = out[1]
        run_stats = out[2] if stats else None
    final, acc = rebuild(final_carry[0]), final_carry[1]
    if readout == "mean":
        acc = tree_map(lambda a: a / T, acc)
    return (acc, final, run_stats or _first_step_stats(T, kwargs)) if stats else (acc, final)


def _without_none_leaves(step: Any, state: Any) -> tuple[Any, Any, Callable[[Any], Any]]:
    """``(step', state', rebuild)``: when ``state`` (after step 0) holds ``None`` leaves that
    stay ``None`` (Norse's ``SequentialState`` returns ``None`` for its stateless layers),
    scan carries its tensor leaves only; ``step'`` puts the ``None`` back around each call
    (and checks they stay), ``rebuild`` restores the structure of a final state."""
    tree = torch.utils._pytree
    leaves, spec = tree.tree_flatten(state)
    holes = [leaf is None for leaf in leaves]
    other = [leaf for leaf in leaves if leaf is not None and not isinstance(leaf, Tensor)]
    if other:
        raise TypeError(
            f"step 0 returned a state with a {type(other[0]).__name__} leaf; every state leaf "
            "after the first step must be a tensor (or None, kept as None)"
        )
    if not any(holes):
        return step, state, lambda s: s

    def fill(tensors: list[Tensor]) -> Any:
        it = iter(tensors)
        return tree.tree_unflatten([None if h else next(it) for h in holes], spec)

    def strip(full: Any, t: str) -> list[Tensor]:
        got, got_spec = tree.tree_flatten(full)
        if got_spec != spec or [leaf is None for leaf in got] != holes:
            raise ValueError(
                f"step {t} returned a state with another structure (or other None leaves) than "
                "step 0's; the state structure must not change between steps"
            )
        return [leaf for leaf in got if leaf is not None]

    def stripped_step(tensors: list[Tensor], x_t: Any) -> tuple[list[Tensor], Any]:
        new, y = step(fill(tensors), x_t)
        return strip(new, ">0"), y

    return stripped_step, strip(state, "0"), fill


def _scan_shaped(step: Any, inputs: Any, state: Any, **kwargs: Any) -> Any:
    """``scan`` from a state that step 0 shaped (run as it is, 0-d leaves included)."""
    token = _SHAPED.set(id(state))
    try:
        return scan(step, inputs, state, **kwargs)
    finally:
        _SHAPED.reset(token)


def _first_step_stats(T: int, kwargs: dict[str, Any]) -> ScanStats:
    """Stats of a run that was step 0 alone (T=1 from a state step 0 shapes)."""
    run_stats = ScanStats(
        plan="step 0 only", schedule=None, T=T, storage=kwargs.get("storage", "host")
    )
    run_stats.forward_steps = 1
    run_stats.backward_steps = 0
    return run_stats


def _finish(
    outs: list[Tensor],
    n_out: int,
    fn: _StepFn,
    state_def: TreeDef,
    fold: ReadoutFn | None,
    run_stats: ScanStats | None,
) -> Any:
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
    if run_stats is not None:
        return ys, final_state, run_stats
    return ys, final_state
