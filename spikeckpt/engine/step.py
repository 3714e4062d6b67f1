"""The user's step as the engine runs it: flat leaves in and out, checked at step 0.

`StepFn` wraps ``step(state, x_t) -> (state, y_t)`` into a function of flat tensor
lists (the executor's view), checks the structure, shapes and dtypes it returns and carries a
callable readout as extra state. `default_params` finds the tensors a step
differentiates (the parameters of the modules it reaches) and guards the running statistics of
the normalisation layers it reaches (`guard_running_stats`), so recomputed steps do not
update them twice. `time_leaves` turns the inputs into time-first leaves.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from spikeckpt.engine.grad import not_behind, unseen_leaves
from spikeckpt.engine.inputs import is_packed
from spikeckpt.engine.phase import guard_running_stats, refuse_power_iteration
from spikeckpt.engine.readout import ReadoutFn
from spikeckpt.engine.rng import refuse_own_generators
from spikeckpt.engine.tree import TreeDef, tree_flatten, tree_map
from spikeckpt.errors import ConfigError, ConfigTypeError, UnlistedParamsError, UsageError

__all__ = [
    "StepFn",
    "default_params",
    "in_place_error",
    "readout_params",
    "no_own_draws",
    "reachable_generators",
    "time_leaves",
    "unshaped",
]


#: torch's messages for an in-place op on a leaf requiring grad (the engine's stored states,
#: a block's stored input spikes) or on a view of one
_IN_PLACE_MESSAGES = (
    "is being used in an in-place operation",
    "is a view and is being modified inplace",
)


def in_place_error(err: RuntimeError) -> bool:
    """Whether ``err`` is torch refusing an in-place change of a leaf that requires grad (or
    of a view of one): what a step, readout or layer that writes the tensor it is given
    meets when the engine hands it a stored tensor again."""
    return any(message in str(err) for message in _IN_PLACE_MESSAGES)


_STATE_IN_PLACE = (
    "spikeckpt.scan: the step changes the state it is given in place (v.mul_(0.9), v += x, "
    "v[...] = ...): a checkpointed run hands the states it stored to recomputed steps, as "
    "leaves requiring grad, which must stay as they were (before 2026-11-29 this surfaced as "
    "torch's 'a leaf Variable that requires grad is being used in an in-place operation'); "
    "compute a new tensor instead: v = v * 0.9 + x"
)


_ACC_IN_PLACE = (
    "spikeckpt.scan: the callable readout changes its accumulator in place (acc += y_t, "
    "acc.add_(y_t)): the accumulator is carried as state, and a checkpointed run hands "
    "stored states to recomputed steps as leaves requiring grad, which must stay as they "
    "were; return a new tensor instead: acc = acc + y_t"
)


def _described(state: Any) -> str:
    """What a step returned as its state, for an error message (``a tuple of 9 tensors``)."""
    try:
        return tree_flatten(state)[1].describe()
    except Exception:  # noqa: BLE001 - a message, never a second error
        return type(state).__name__


class StepFn:
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
        leaves: list[Any] | None
        if self.y_def is None:
            leaves, self.y_def = tree_flatten(y)
            for name, leaf in zip(self.y_def.names, leaves, strict=False):
                if not isinstance(leaf, Tensor):
                    raise ConfigTypeError(
                        f"step output y{name} is {type(leaf).__name__}, not a tensor"
                    )
            self.y_meta = [(leaf.shape, leaf.dtype) for leaf in leaves]
            return leaves
        leaves = self.y_def.flatten(y) if y is not None else None
        if leaves is None:
            raise ConfigError(
                f"step {t} returned an output y with another structure than step 0 "
                f"(expected {self.y_def.describe()})"
            )
        if check:
            for name, leaf, (shape, dtype) in zip(
                self.y_def.names, leaves, self.y_meta, strict=False
            ):
                if leaf.shape != shape or leaf.dtype != dtype:
                    raise ConfigError(
                        f"step {t} returned output y{name} of shape {tuple(leaf.shape)} and "
                        f"dtype {leaf.dtype}; step 0 gave {tuple(shape)}, {dtype}"
                    )
        return leaves

    def _call(self, t: int, user: list[Tensor], xs: list[Tensor], check: bool) -> Any:
        """The user's step on the rebuilt state and input (checked to be a 2-tuple)."""
        if check and t == 0 and self.unseen_check:
            # the no-grad path while grad is on: nothing scan sees requires grad. Run step 0
            # with grad to find tensors requiring grad that the step reaches unseen.
            with torch.enable_grad():
                out = self.step(self.state_def.unflatten(user), self.in_def.unflatten(xs))
            if isinstance(out, tuple) and len(out) == 2:
                self._warn_closures(user, xs, tree_flatten(out)[0], no_grad_path=True)
                out = tree_map(lambda v: v.detach() if isinstance(v, Tensor) else v, out)
        else:
            try:
                out = self.step(self.state_def.unflatten(user), self.in_def.unflatten(xs))
            except RuntimeError as err:
                if in_place_error(err) and any(t.requires_grad for t in user):
                    raise UsageError(_STATE_IN_PLACE) from err
                raise
        if check and not (isinstance(out, tuple) and len(out) == 2):
            got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
            raise ConfigTypeError(
                f"step must return a 2-tuple (state, y_t); step {t} returned {got}"
            )
        return out

    def __call__(
        self, t: int, leaves: list[Tensor], xs: list[Tensor], check: bool
    ) -> tuple[list[Tensor], list[Tensor]]:
        n = self.n
        user = leaves[:n] if self.fold is not None else leaves
        new_state, y = self._call(t, user, xs, check)
        new = self.state_def.flatten(new_state)
        if new is None:
            raise ConfigError(
                f"step {t} returned a state that is not {self.state_def.describe()} like the "
                f"initial state (got {_described(new_state)}); the state structure must not "
                "change between steps: start from an initial state of the structure the step "
                "returns"
            )
        if check:
            self._check_state(t, new, xs)
        ys = self._flat_y(t, y, check)
        acc = [] if self.fold is None else self._folded(t, leaves[n:], y)
        if check and not self.scanned_closures and torch.is_grad_enabled():
            # the outputs (a head applied to the spikes) and the fold's accumulator too: a
            # readout matrix of its own not in ``params``
            self._warn_closures(leaves, xs, new + ys + acc)
        if self.fold is None:
            return new, ys
        return new + acc, []

    def _folded(self, t: int, acc_leaves: list[Tensor], y: Any) -> list[Tensor]:
        """The callable readout's new accumulator leaves after step ``t``."""
        assert self.fold is not None
        acc = None if t == 0 else self.acc_def.unflatten(acc_leaves)  # type: ignore[union-attr]
        try:
            acc = self.fold(acc, y, t)
        except RuntimeError as err:
            if in_place_error(err) and any(a.requires_grad for a in acc_leaves):
                raise UsageError(_ACC_IN_PLACE) from err
            raise
        new: list[Any] | None
        if self.acc_def is None:
            new, self.acc_def = tree_flatten(acc)
            if not all(isinstance(a, Tensor) for a in new):
                raise ConfigTypeError(
                    "a callable readout must return a tensor or a pytree of tensors"
                )
            return new
        new = self.acc_def.flatten(acc)
        if new is None:
            raise ConfigError(f"the readout returned another structure at step {t}")
        return new

    def _check_state(self, t: int, new: list[Any], xs: list[Tensor]) -> None:
        for name, leaf, (shape, dtype, device) in zip(self.names, new, self.meta, strict=False):
            if not isinstance(leaf, Tensor):
                raise ConfigTypeError(
                    f"step {t} returned {name} = {type(leaf).__name__}, not a tensor"
                )
            if leaf.shape != shape or leaf.dtype != dtype or leaf.device != device:
                raise ConfigError(
                    f"step {t} changed {name}: it is {tuple(leaf.shape)} {leaf.dtype} on "
                    f"{leaf.device}, the initial state's is {tuple(shape)} {dtype} on {device}; "
                    "the state's shapes and dtypes must stay the same at every step"
                    + (
                        f" (step 0 returns this state in {leaf.dtype} from a {dtype} one: "
                        "scan carries the dtypes step 0 returns by running it apart, as under "
                        "torch.autocast, but not with a Schedule built for all T steps: build "
                        f"it for T-1, or pass an initial state in {leaf.dtype})"
                        if leaf.dtype != dtype and leaf.shape == shape and t == 0
                        else ""
                    )
                    + _shape_hint(t, tuple(shape), tuple(leaf.shape), xs)
                )

    def _warn_closures(
        self,
        user: list[Tensor],
        xs: list[Tensor],
        new: list[Any],
        *,
        no_grad_path: bool = False,
    ) -> None:
        """Raise [`UnlistedParamsError`][spikeckpt.errors.UnlistedParamsError] if the step uses
        leaf tensors requiring grad that are not in ``params`` (they would get no gradient).

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
            f"nn.Parameter also works).{_stale_attribute_hint(self.step, found)}",
            found,
        )


def _stale_attribute_hint(step: Any, found: list[Tensor]) -> str:
    """For unlisted tensors that are parameters of the modules ``step`` reaches: they were left
    out of the default ``params`` because a tuple attribute of such a module holds tensors
    computed from them (``m.state``, a NamedTuple an earlier call left with its graph); name
    the attribute and the ways forward. Empty otherwise (an error path only)."""
    _, modules = reachable(step)
    own = {id(p) for m in modules for p in m.parameters()}
    if not any(id(t) in own for t in found):
        return ""
    holders = [
        f"{type(m).__name__}.{name}"
        for m in modules
        for name, value in vars(m).items()
        if isinstance(value, tuple)
        and any(isinstance(v, Tensor) and v.grad_fn is not None for v in value)
    ]
    where = ", ".join(holders[:3]) or "an attribute of a module the step reaches"
    return (
        " They are parameters of the modules the step reaches, left out because "
        f"{where} holds tensors computed from them (a state an earlier call left there, with "
        "its graph): clear it before the call (model.reset(), or set it to None), or pass "
        "params=list(model.parameters())."
    )


# ----------------------------------------------------------------------------- inputs


def _same_step_shape(column: list[Tensor], leaf: Tensor, t: int, steps: int) -> None:
    """Refuse per-step input ``t`` whose leaf is not shaped like input 0's (``torch.stack``'s
    own error names neither the steps nor the likely cause: time-first tensors given as a
    tuple, which is read as a sequence of ``steps`` steps)."""
    if column and leaf.shape != column[0].shape:
        raise ConfigError(
            f"per-step input {t} is {tuple(leaf.shape)}, input 0 is "
            f"{tuple(column[0].shape)}: a sequence of inputs is read as "
            f"{steps} steps, one input each, and every step's input must have the same shape. "
            "Several time-first inputs (T, ...) go in as per-step pairs: "
            "list(zip(spikes, current))"
        )


def time_leaves(inputs: Any) -> tuple[list[Tensor], TreeDef, int]:
    """Time-first input leaves ``(T, ...)``, the per-step structure, and ``T``."""
    if is_packed(inputs):  # a packed train: one leaf, unpacked step by step
        return [inputs], TreeDef("tensor", None, None, 1, [""]), _length(inputs.T)
    if isinstance(inputs, Tensor):
        if inputs.dim() == 0:
            raise ConfigError(
                "inputs must have a leading time dimension (T, ...); got a 0-d tensor"
            )
        return [inputs], TreeDef("tensor", None, None, 1, [""]), _length(inputs.shape[0])
    if isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)):
        _length(len(inputs))
        _refuse_parallel_looking_tuple(inputs)
        first, in_def = tree_flatten(inputs[0])
        columns: list[list[Tensor]] = [[] for _ in first]
        for t, item in enumerate(inputs):
            leaves = in_def.flatten(item)
            if leaves is None or not all(isinstance(x, Tensor) for x in leaves):
                raise ConfigTypeError(_not_a_step_input(t, in_def, item, leaves))
            for column, leaf in zip(columns, leaves, strict=False):
                _same_step_shape(column, leaf, t, len(inputs))
                column.append(leaf)
        return [torch.stack(column) for column in columns], in_def, len(inputs)
    several = (
        ": several time-first inputs go in as per-step items, list(zip(a, b)), a dict d of "
        "them as [dict(zip(d, v)) for v in zip(*d.values())]"
        if isinstance(inputs, Mapping)
        else ""
    )
    raise ConfigTypeError(
        f"inputs must be a time-first tensor (T, ...) or a sequence of per-step inputs, "
        f"got {type(inputs).__name__}{several}"
    )


def _refuse_parallel_looking_tuple(inputs: Sequence[Any]) -> None:
    """Refuse a tuple of 2-8 tensors of one shape ``(T', ...)`` with ``T'`` above their count:
    time-first inputs meant in parallel (``x_t = (a[t], b[t])``, as ``jax.lax.scan`` reads a
    tuple) that a sequence of per-step inputs would run as 2-8 steps, silently (the outputs of
    a readout then have the loop's shape). A list of per-step inputs is never refused."""
    if not isinstance(inputs, tuple) or not 2 <= len(inputs) <= 8:
        return
    if not all(isinstance(x, Tensor) for x in inputs):
        return
    shape = inputs[0].shape
    if len(shape) < 2 or shape[0] <= len(inputs) or any(x.shape != shape for x in inputs):
        return
    n = len(inputs)
    names = ", ".join("abcdefgh"[:n])
    raise ConfigError(
        f"inputs is a tuple of {n} tensors of shape {tuple(shape)}: scan reads a tuple as a "
        f"sequence of {n} steps (x_t = inputs[t]), though each looks time-first "
        f"({shape[0]} steps). For {n} time-first inputs read in parallel "
        f"(x_t = ({', '.join(f'{c}[t]' for c in names)})), pass list(zip({names})); for {n} "
        f"per-step inputs, pass them as a list"
    )


def _not_a_step_input(t: int, in_def: TreeDef, item: Any, leaves: list[Any] | None) -> str:
    """Why per-step input ``t`` (``item``, its ``leaves`` flattened as input 0's or None) of a
    sequence is refused: another structure than input 0's, or a leaf that is not a tensor (a
    packed train among per-step inputs: input 0's own structure then read "a pytree *")."""
    others = [x for x in leaves or [] if not isinstance(x, Tensor)]
    if leaves is None and is_packed(item):
        others = [item]
    if not others:
        return f"per-step input {t} is not {in_def.describe()} like input 0"
    if is_packed(others[0]):
        return (
            f"per-step input {t} holds a packed train ({type(others[0]).__name__}): a packed "
            "train is a whole time-first input (T, ...) and goes in alone, "
            "scan(step, train, ...); beside other inputs, pass per-step pairs of dense "
            "steps: list(zip(train.dense(), current))"
        )
    return (
        f"per-step input {t} holds a {type(others[0]).__name__} where a tensor is expected: each "
        "step's input is a tensor or a pytree (tuple, list, dict, NamedTuple) of tensors"
    )


def _length(T: int) -> int:
    if T == 0:
        raise ConfigError("inputs hold T=0 time steps; scan needs T >= 1")
    return int(T)


def unshaped(leaves: list[Any]) -> bool:
    """Whether the initial state has leaves whose shape the first step sets: ``None``, empty
    tensors (snnTorch's ``init_leaky()``) or 0-d tensors (Norse's ``initial_state(x).v``)."""
    return any(
        t is None or (isinstance(t, Tensor) and (t.dim() == 0 or t.numel() == 0)) for t in leaves
    )


# ----------------------------------------------------------------------------- parameters


def default_params(step: Any, params: Sequence[Tensor] | None, fold: Any = None) -> list[Tensor]:
    """The distinct tensors requiring grad among ``params`` (default: those reachable from
    ``step`` and from a callable readout ``fold``, see `reachable`); guards the running
    statistics of the normalisation layers they reach (`guard_running_stats`); a leaf behind
    another's graph is left out (`not_behind`). The fold runs inside each step, recomputed
    with it: a readout matrix or head module of its own is differentiated like the step's
    (before 2026-11-29 it was left at ``.grad`` None, and a BatchNorm there counted each
    recomputed step again)."""
    found, modules = reachable(step)
    if fold is not None:
        more, fold_modules = reachable(fold)
        found, modules = [*found, *more], [*modules, *fold_modules]
    guard_running_stats(modules)
    if torch.is_grad_enabled():
        refuse_power_iteration(modules)
    if params is None:
        params = found
    unique: dict[int, Tensor] = {}
    for p in params:
        if not isinstance(p, Tensor):
            raise ConfigTypeError(f"params must be tensors, got {type(p).__name__}")
        if p.requires_grad:
            unique.setdefault(id(p), p)
    return not_behind(list(unique.values()))


def readout_params(readout: Any) -> list[Tensor]:
    """The tensors requiring grad that a callable readout reaches (its own readout matrix or
    head module: see `reachable`); none for a named readout."""
    return reachable(readout)[0] if callable(readout) else []


@functools.cache
def _code_globals(code: Any) -> tuple[str, ...]:
    """Global names a code object (and the code objects nested in it) loads: its
    ``LOAD_GLOBAL`` / ``LOAD_NAME`` instructions' names. Not every name of ``co_names``,
    which holds attribute names too: ``self.out`` named a module-level ``out`` (a previous
    call's result), whose outputs then joined the next call's parameters and its backward
    reached the previous call's freed graph. Cached per code object (read at every scan)."""
    names = [
        str(ins.argval)
        for ins in dis.get_instructions(code)
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    ]
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names.extend(_code_globals(const))
    return tuple(names)


class _Reach:
    """A walk from a step through what it can reach (see `reachable`)."""

    def __init__(self) -> None:
        self.found: dict[int, Tensor] = {}
        self.seen: set[int] = set()
        self.modules: dict[int, nn.Module] = {}
        #: ``torch.Generator``s of the user's own (scan replays the default generators only)
        self.generators: dict[int, torch.Generator] = {}

    def visit(self, obj: Any, depth: int) -> None:
        if depth > 4 or id(obj) in self.seen or isinstance(obj, (types.ModuleType, type, str)):
            return
        self.seen.add(id(obj))
        for kind, visit in self._VISITS:
            if isinstance(obj, kind):
                visit(self, obj, depth + 1)
                return
        if inspect.ismethod(obj):
            self.visit_all((obj.__self__, obj.__func__), depth + 1)
        elif inspect.isfunction(obj):
            self._function(obj, depth + 1)
        elif callable(obj) and hasattr(obj, "__dict__") and not inspect.isbuiltin(obj):
            self.visit_all(list(vars(obj).values())[:100], depth + 1)

    def visit_all(self, items: Any, depth: int) -> None:
        for item in items:
            self.visit(item, depth)

    def _tensor(self, t: Tensor, depth: int) -> None:
        if t.requires_grad:
            self.found.setdefault(id(t), t)

    def _module(self, module: nn.Module, depth: int) -> None:
        for p in module.parameters():
            self._tensor(p, depth)
        for m in module.modules():
            self.modules.setdefault(id(m), m)
            for value in vars(m).values():
                if isinstance(value, tuple):
                    self.visit(value, depth)
                elif isinstance(value, Tensor) and value.is_leaf:
                    self._tensor(value, depth)  # a tensor attribute: self.beta = torch.full(..)
                elif isinstance(value, torch.Generator):
                    self._generator(value, depth)

    def _generator(self, gen: torch.Generator, depth: int) -> None:
        self.generators.setdefault(id(gen), gen)

    def _partial(self, obj: functools.partial, depth: int) -> None:
        self.visit_all((obj.func, *obj.args, *obj.keywords.values()), depth)

    def _sequence(self, obj: Any, depth: int) -> None:
        self.visit_all(list(obj)[:1000], depth)

    def _dict(self, obj: dict, depth: int) -> None:
        self.visit_all(list(obj.values())[:1000], depth)

    def _function(self, fn: Any, depth: int) -> None:
        for cell in fn.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell
                self.visit(cell.cell_contents, depth)
        self.visit_all((*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()), depth)
        scope = fn.__globals__
        names = dict.fromkeys(_code_globals(fn.__code__))
        self.visit_all([scope[name] for name in names if name in scope], depth)

    _VISITS: tuple[tuple[Any, Callable[..., None]], ...] = (
        (Tensor, _tensor),
        (torch.Generator, _generator),
        (nn.Module, _module),
        (functools.partial, _partial),
        ((list, tuple, set, frozenset), _sequence),
        (dict, _dict),
    )


def reachable(step: Any) -> tuple[list[Tensor], list[nn.Module]]:
    """Tensors requiring grad reachable from ``step``: parameters of the modules it is, is
    bound to, closes over, takes as defaults or ``partial`` arguments, or names as globals
    (through the functions and containers it reaches, a few levels deep), tensors requiring
    grad among those, leaf tensors requiring grad held as attributes of those modules (a
    neuron's ``self.beta = torch.full(..., requires_grad=True)``) or in their NamedTuple
    attributes (Norse keeps neuron parameters in ``module.p``); and the modules reached
    (submodules included)."""
    walk = _Reach()
    walk.visit(step, 0)
    return list(walk.found.values()), list(walk.modules.values())


def reachable_generators(step: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects reachable from ``step`` (as `reachable` walks: its
    closure, defaults, globals, bound ``self`` and the attributes of the modules it reaches)."""
    walk = _Reach()
    walk.visit(step, 0)
    return list(walk.generators.values())


@contextlib.contextmanager
def no_own_draws(root: Any, who: str, way: str) -> Iterator[None]:
    """Around a forward pass that its backward recomputes: the ``torch.Generator``s reachable
    from ``root`` (a step, a module) must not draw (`refuse_own_generators`); nothing is
    checked without grad (nothing will be recomputed)."""
    generators = reachable_generators(root) if torch.is_grad_enabled() else []
    before = [g.get_state() for g in generators]
    yield
    refuse_own_generators(generators, before, who, way)


def _shape_hint(t: int, before: tuple[int, ...], after: tuple[int, ...], xs: list[Tensor]) -> str:
    """What a state leaf whose shape changed from ``before`` to ``after`` at step ``t`` may say:
    one whose size-1 axes broadcast at step 0 (a learned ``h0`` of shape ``(1, H)``) is
    expanded to the batch; any other, the input's layout (`_layout_hint`). Empty where the
    shape held."""
    if before == after:
        return ""
    broadcasts = (
        t == 0
        and len(before) == len(after)
        and all(b in (1, a) for b, a in zip(before, after, strict=True))
    )
    if not broadcasts:
        return _layout_hint(xs)
    return (
        f". The initial {before} broadcast to {after} at step 0 (a learned initial state such "
        "as h0 of shape (1, H)), which the plain loop allows but a checkpointed run cannot "
        f"store: start from the full shape, h0.expand({', '.join(map(str, after))}) (in an "
        "initial_state(x) method: the batch is x.shape[0]); the expanded view gets the loop's "
        "gradient"
    )


def _layout_hint(xs: list[Tensor]) -> str:
    """What a state whose shape changed may say of the input's layout: scan reads ``x`` time
    first, and each step gets ``x[t]``."""
    shapes = ", ".join(str(tuple(x.shape)) for x in xs[:3] if isinstance(x, Tensor))
    return (
        f". Each step's input x[t] is {shapes}: scan reads x time first, (T, B, ...); a "
        "batch-first x (B, T, ...) goes in as x.transpose(0, 1), and one input fed at every "
        "step (B, ...) as scan(step, x, state, steps=T)"
    )
