"""Adapters for plain ``torch.nn`` layers, for your own layers and neurons, and for RNN cells.

- `StatelessAdapter`: Linear, Conv, Flatten, Dropout, pooling, padding, activations,
  LayerNorm/GroupNorm, BatchNorm/InstanceNorm, Identity, ... : state ``()``, ``y_t = module(x_t)``.
  BatchNorm in training mode with running statistics updates them once per step in the forward
  pass, as the plain loop does, and never in recomputation (nor in shape probes): the statistics
  buffers are detached from the module while the engine recomputes
  (`spikeckpt.engine.phase.recomputing`), which leaves the output unchanged (training mode
  normalises with the batch's own statistics).
- `CustomLayerAdapter`: a module of yours with ``forward(x)`` and no state: stepped as a
  stateless layer without registration. A module that keeps state on itself between calls
  (assigns ``self.something`` in ``forward``) is detected at its first step and named.
- `StatefulAdapter`: a module of yours whose ``forward`` takes the state after the input,
  recognised by its arity: ``forward(x, state) -> (y, state)``, or ``forward(x, s1, s2, ...) ->
  (y, s1, s2, ...)`` (argument names do not matter). The initial state comes from its
  ``initial_state(x_t)`` / ``init_state(x_t)`` method when it has one; else, when its second
  argument defaults to ``None``, it is ``None`` (the module builds its own state at step 0, as in
  your loop); else it is zeros shaped like the state one step returns.
- `RNNCellAdapter`: ``nn.RNNCell`` / ``nn.GRUCell`` (state ``h``), ``nn.LSTMCell``
  (state ``(h, c)``); ``y_t = h``.

A module of yours (a class not defined by torch, snnTorch or Norse) whose ``forward(x)`` runs
layers that keep state (neurons), or loops over time, is a model with its own time loop: it
raises [`UnsupportedLayerError`][spikeckpt.errors.UnsupportedLayerError] showing how to hand the loop body to
[`spikeckpt.scan`][spikeckpt.engine.scan.scan] (see ``docs/own-model.md``).
"""

from __future__ import annotations

import contextlib
import dis
import inspect
import re
import types
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from spikeckpt.adapters.pooling import fast_max_pool
from spikeckpt.adapters.protocol import (
    AdapterFor,
    LayerAdapter,
    Registration,
    State,
    no_hooks,
    plain_container,
    unsupported,
)
from spikeckpt.adapters.returns import state_order_problem
from spikeckpt.engine.compiled import is_compiling
from spikeckpt.engine.phase import RUNNING_STATS_TYPES, frozen_running_stats, recomputing
from spikeckpt.engine.rng import kept_generators
from spikeckpt.engine.tree import fresh_containers, tree_leaves, tree_map, tree_structure
from spikeckpt.errors import ConfigError, UnsupportedLayerError

__all__ = [
    "PER_SAMPLE_TYPES",
    "RUNNING_STATS_TYPES",
    "STATELESS_TYPES",
    "CustomLayerAdapter",
    "HiddenStateAdapter",
    "RNNCellAdapter",
    "StatefulAdapter",
    "StatelessAdapter",
    "frozen_running_stats",
    "own_class",
    "own_loop_error",
    "probe",
    "positional_params",
    "WRITTEN_BY_CLASS",
    "refuse_graph_attributes",
    "refuse_kept_state",
    "users_subclass",
    "probing",
    "registrations",
    "state_arity",
    "unset_state_refusal",
]


def _types(*names: str) -> tuple[type, ...]:
    return tuple(getattr(nn, n) for n in names if hasattr(nn, n))


_ACTIVATIONS = _types(
    "ReLU",
    "ReLU6",
    "LeakyReLU",
    "PReLU",
    "RReLU",
    "ELU",
    "SELU",
    "CELU",
    "GELU",
    "SiLU",
    "Mish",
    "Sigmoid",
    "LogSigmoid",
    "Tanh",
    "Tanhshrink",
    "Hardtanh",
    "Hardsigmoid",
    "Hardswish",
    "Hardshrink",
    "Softshrink",
    "Softplus",
    "Softsign",
    "Softmax",
    "Softmin",
    "LogSoftmax",
    "Softmax2d",
    "Threshold",
    "GLU",
)

#: Stateless ``torch.nn`` layers that act on each sample of a batch independently: a time chunk
#: ``(k, B, ...)`` may be applied as one ``(k * B, ...)`` batch (layer-wise granularity).
#: BatchNorm is not one of them (it normalises over the batch), nor ``RReLU`` (random in
#: training), nor the ``Fractional*`` poolings (random).
PER_SAMPLE_TYPES: tuple[type, ...] = (
    nn.Identity,
    nn.Linear,
    nn.Bilinear,
    nn.modules.conv._ConvNd,
    nn.Flatten,
    nn.Unflatten,
    nn.modules.dropout._DropoutNd,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.modules.pooling._LPPoolNd,
    nn.modules.padding._ConstantPadNd,
    nn.modules.padding._ReflectionPadNd,
    nn.modules.padding._ReplicationPadNd,
    *_types(
        "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d"
    ),
    nn.LayerNorm,
    nn.GroupNorm,
    *_types("RMSNorm"),
    nn.Upsample,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    *_types("ChannelShuffle"),
    nn.Embedding,
    *(t for t in _ACTIVATIONS if t is not getattr(nn, "RReLU", None)),
)

#: ``torch.nn`` layer types stepped as pure functions of one time step's input (the one
#: definition; `PER_SAMPLE_TYPES` is the per-sample subset).
STATELESS_TYPES: tuple[type, ...] = (
    *PER_SAMPLE_TYPES,
    *_types(
        "RReLU",
        "FractionalMaxPool2d",
        "FractionalMaxPool3d",
        "MaxUnpool1d",
        "MaxUnpool2d",
        "MaxUnpool3d",
    ),
    nn.LocalResponseNorm,
    nn.CosineSimilarity,
    nn.PairwiseDistance,
    *RUNNING_STATS_TYPES,
)


# ----------------------------------------------------------------------------- probes

_PROBING: ContextVar[bool] = ContextVar("spikeckpt_probing", default=False)


def probing() -> bool:
    """``True`` inside `probe`: a call that only learns shapes and must change nothing."""
    return _PROBING.get()


def probe(fn: Any, *args: Any, module: nn.Module | None = None) -> Any:
    """Call ``fn(*args)`` without autograd, without consuming random numbers (the default
    generators', and those held by the layers of ``module``, default ``fn``'s adapter's) and
    without updating running statistics (a shape probe)."""
    x = next((a for a in args if isinstance(a, Tensor)), None)
    devices = [x.device.index or 0] if x is not None and x.is_cuda else []
    if module is None:
        module = getattr(getattr(fn, "__self__", None), "module", None)
    token = _PROBING.set(True)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), kept_generators(module):
            return fn(*args)
    finally:
        _PROBING.reset(token)


def _side_effects_off() -> bool:
    """Whether this evaluation repeats one already done (recomputation) or only probes."""
    return recomputing() or probing()


# ----------------------------------------------------------------------------- adapters


class StatelessAdapter(LayerAdapter):
    """A layer without state: ``y_t = module(x_t)`` (running statistics updated only in the
    first evaluation of each step; a plain ``nn.MaxPool2d`` without hooks through torch's
    channels-last kernel, `spikeckpt.adapters.pooling`: the same values and gradients)."""

    stateful = False

    def __init__(self, module: nn.Module, path: str = "") -> None:
        super().__init__(module, path)
        self._stats = [m for m in module.modules() if isinstance(m, RUNNING_STATS_TYPES)]
        self._pool = fast_max_pool(module)

    def init_state(self, x_t: Tensor) -> State:
        return ()

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        if self._pool is not None and not is_compiling() and no_hooks(self.module):
            pooled = self._pool(x_t)
            if pooled is not None:
                return (), pooled
        if self._stats and _side_effects_off():
            with frozen_running_stats(self._stats):
                return (), self.module(x_t)
        return (), self.module(x_t)


_NO_VALUE = object()


_PLAIN = (int, float, bool, str, bytes, type(None))


def _value_key(v: Any, *, nested: bool = True) -> Any:
    """What identifies an attribute's value between two looks: the object and, for a tensor,
    its in-place version counter; a plain value (a number, a string, a ``torch.Size``) by
    itself, so that writing the same value again (``self.batchSize = x.size(0)`` at every
    call) is no change, at any batch size (ints above 256 are new objects at each call); a
    small list, dict or namespace (``nested``) by its entries, each one level deep."""
    if isinstance(v, Tensor):
        return (id(v), v._version)
    if type(v) in _PLAIN:
        return (type(v), v)
    if type(v) in (tuple, torch.Size) and all(type(e) in _PLAIN for e in v):
        return (type(v), tuple(v))
    entries = _container_entries(v) if nested else None
    if entries is not None:
        return (id(v), tuple((k, _value_key(e, nested=False)) for k, e in entries))
    return id(v)


#: what torch's ``nn.Module.__init__`` puts in every module's ``__dict__`` (its hooks,
#: parameters, submodules, ``training``): torch's to manage, not state of yours
_MODULE_OWN = frozenset(nn.Module().__dict__)

#: containers longer than this are compared by identity alone (a large cache of yours)
_CONTAINER_ENTRIES = 64


def _container_entries(v: Any) -> list[tuple[Any, Any]] | None:
    """The entries of a list, dict or ``types.SimpleNamespace`` held as an attribute, whose
    contents a forward may change without assigning the attribute (SpikingJelly's
    ``self._memories["v"]``, ``self.mem[0] = v``, ``self.h.v = v``); ``None`` for anything
    else, or for a container too large to compare at each step."""
    if type(v) is list:
        entries: list[tuple[Any, Any]] = list(enumerate(v))
    elif type(v) is dict:
        entries = list(v.items())
    elif type(v) is types.SimpleNamespace:
        entries = list(vars(v).items())
    else:
        return None
    return entries if len(entries) <= _CONTAINER_ENTRIES else None


#: torch's messages for an input of the wrong shape
_SHAPE_ERROR = re.compile(r"shape|size|dimension|cannot be multiplied|expected .*input")


class CustomLayerAdapter(StatelessAdapter):
    """A module of yours with ``forward(x)`` and no state: ``y_t = module(x_t)``.

    Every step checks that the call left the module (and its submodules) as it found them:
    an attribute assigned in ``forward`` (``self.mem = ...``, ``self.calls += 1``) or a buffer
    changed in place is state kept between calls, which a checkpointed run would replay out of
    order: it raises [`UnsupportedLayerError`][spikeckpt.errors.UnsupportedLayerError] naming the attribute.
    BatchNorm's running statistics are not state (see `StatelessAdapter`).
    """

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        try:
            with refuse_kept_state(self.module, self.path):
                return super().step(state, x_t)
        except AttributeError as err:
            refusal = unset_state_refusal(self.module, self.path, err)
            if refusal is None:
                raise
            raise refusal from err
        except RuntimeError as err:
            if not probing() or not _SHAPE_ERROR.search(str(err)):
                raise
            raise unsupported(
                self.module,
                self.path,
                f"its forward failed on one time step, x_t of shape {tuple(x_t.shape)} "
                f"({str(err).splitlines()[0]}). spikeckpt calls each layer once per step, as "
                "your per-step loop does; a layer written for the whole sequence (T, B, ...), "
                "such as SpikingJelly's SeqToANNContainer or a step_mode='m' module, must be "
                "ported to one step: use the module it wraps (the Linear, the Conv2d) itself",
            ) from err

    def check(self) -> None:
        refuse_graph_attributes(self.module, self.path)


def _assigned_in_forward(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s class's own ``forward`` assigns an attribute ``name``
    (``self.v = ...``: its bytecode stores it)."""
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    if code is None:
        return False
    return any(i.opname == "STORE_ATTR" and i.argval == name for i in dis.get_instructions(code))


def unset_state_refusal(
    module: nn.Module, path: str, err: AttributeError
) -> UnsupportedLayerError | None:
    """The refusal for a layer of yours whose ``forward`` read an attribute it assigns itself
    before any call set it (``v = self.v`` unless ``init``, spikingtorch's ``CoarseLIF``):
    state kept on the module, which your loop sets up at t=0 by an argument spikeckpt does
    not pass. ``None`` when ``err`` is another missing attribute (a bug of its own)."""
    found = re.search(r"'(\w+)' object has no attribute '(\w+)'", str(err))
    if found is None:
        return None
    cls_name, name = found.groups()
    for m in module.modules():
        if type(m).__name__ != cls_name or name in m.__dict__:
            continue
        if not _assigned_in_forward(m, name):
            continue
        params = positional_params(m.forward)
        optional = [p.name for p in (params[0][1:] if params else [])]
        told = ""
        if optional:
            whose = "its default" if len(optional) == 1 else "their defaults"
            told = f" (with {', '.join(optional)} left at {whose})"
        setup = f", passing {optional[0]}=... at t=0" if optional else ""
        return unsupported(
            module,
            path,
            f"its forward read self.{name} before anything set it: it keeps its state on "
            f"itself between calls (your loop sets it up first{setup}). spikeckpt calls a "
            f"layer of yours once per step as forward(x){told}, and again for the steps it "
            "recomputes in the backward pass, so state kept on the module would be replayed "
            "out of order. Return the state instead: forward(x, state) -> (y, state), with "
            "state=None at t=0 (or an initial_state(x) method)",
        )
    return None


def _attributes(
    module: nn.Module, allowed: frozenset[str], buffers: bool
) -> dict[tuple[int, str], Any]:
    """What identifies each attribute (and, with ``buffers``, each buffer but BatchNorm's
    running statistics) of ``module`` and its submodules, but ``allowed`` names."""
    seen: dict[tuple[int, str], Any] = {}
    for m in module.modules():
        for k, v in m.__dict__.items():
            if k in allowed or k in _MODULE_OWN:
                continue
            # private names too where they hold a container of yours (SpikingJelly keeps
            # its neurons' memories in self._memories)
            mine = k.startswith("_spikeckpt")  # what spikeckpt keeps on a module
            if not k.startswith("_") or (not mine and _container_entries(v) is not None):
                seen[(id(m), k)] = _value_key(v)
        if buffers and not isinstance(m, RUNNING_STATS_TYPES):
            for k, v in m._buffers.items():
                if k not in allowed:
                    seen[(id(m), "buffer " + k)] = _value_key(v)
    return seen


def own_class(module: nn.Module) -> type:
    """``module``'s class as you wrote it: a module with a parametrization
    (``torch.nn.utils.parametrize``) has a class torch made, ``Parametrized<Yours>``, whose
    only base is yours."""
    cls = type(module)
    if parametrize.is_parametrized(module) and cls.__name__.startswith("Parametrized"):
        return cls.__bases__[0]
    return cls


def users_subclass(module: nn.Module, library: str) -> bool:
    """Whether ``module``'s class is a subclass of yours of ``library``'s (``"snntorch"``,
    ``"norse"``), defined outside it."""
    return (own_class(module).__module__ or "").split(".")[0] != library


#: attribute names a framework's modules write during every call, by class (the framework
#: adapters fill it: snnTorch's neurons keep their state on themselves, ``self.mem``, which
#: your own loop run before the wrapped one leaves holding its graph)
WRITTEN_BY_CLASS: dict[type, frozenset[str]] = {}


def _written_by(module: nn.Module) -> frozenset[str]:
    """The names `WRITTEN_BY_CLASS` gives ``module``'s class (or a base of it)."""
    found = [names for cls, names in WRITTEN_BY_CLASS.items() if isinstance(module, cls)]
    return frozenset().union(*found)


def refuse_graph_attributes(
    module: nn.Module, path: str, allowed: frozenset[str] = frozenset()
) -> None:
    """Raise [`UnsupportedLayerError`][spikeckpt.errors.UnsupportedLayerError] when ``module``
    (or a submodule) holds a tensor that carries an autograd graph made before the call: an
    attribute or buffer computed from a parameter outside the step (``self.beta =
    torch.sigmoid(raw)``). Its graph can be backpropagated once, and a plan that recomputes
    steps needs it at every segment (before 2026-11-29 the call asked for ``params=[raw]``,
    and with it the backward failed with an error about hooks and ``init_hidden``, or
    torch's "backward through the graph a second time"). Checked at every call: the
    attribute may be assigned after wrapping. ``allowed``: names a framework writes during
    a call (snnTorch's ``mem``, which your own loop may have left holding its graph)."""
    for m in module.modules():
        items = [*m.__dict__.items(), *m._buffers.items()]
        skipped = allowed | _written_by(m)
        for name, v in items:
            if name in skipped or not isinstance(v, Tensor):  # also self._beta = ...
                continue
            if v.grad_fn is None:
                continue
            raise unsupported(
                m,
                path,
                f"its attribute {name!r} holds an autograd graph made before the call (a "
                f"tensor computed from a parameter once: self.{name} = torch.sigmoid(raw) "
                "assigned before the call does so); a checkpointed run recomputes steps and "
                "can take gradients through that graph only once; compute it at each step "
                "instead: keep the raw value as an nn.Parameter and apply the function in "
                "forward, or register it as a parametrization (torch.nn.utils.parametrize."
                f"register_parametrization(module, {name!r}, nn.Sigmoid()))",
            )


@contextlib.contextmanager
def refuse_kept_state(
    module: nn.Module, path: str, allowed: frozenset[str] = frozenset(), *, buffers: bool = True
) -> Iterator[None]:
    """Raise [`UnsupportedLayerError`][spikeckpt.errors.UnsupportedLayerError] naming the
    attribute where the call inside left ``module`` (or a submodule) otherwise than it found
    it: an attribute assigned (``self.count = self.count + z.sum()``, but ``allowed`` names,
    the state its adapter manages) or, with ``buffers``, a buffer changed in place. That is
    state kept between calls, which a checkpointed run would replay out of order."""
    before = _attributes(module, allowed, buffers)
    yield
    after = _attributes(module, allowed, buffers)
    if after == before:
        return
    names = {id(m): n for n, m in module.named_modules()}
    changed = sorted(
        (names.get(key[0], "?"), key[1])
        for key in after.keys() | before.keys()
        if after.get(key, _NO_VALUE) != before.get(key, _NO_VALUE)
    )
    where = ", ".join(f"self.{(n + '.') if n else ''}{k}" for n, k in changed[:5])
    added = [key for key in after.keys() & before.keys() if _only_added(before[key], after[key])]
    raise unsupported(
        module,
        path,
        f"it keeps state on itself between calls: its forward changed {where}. A "
        "checkpointed run calls each step again during backward, so state kept on the "
        "module would be replayed out of order. Return the state instead: "
        "forward(x, state) -> (y, state), with state=None at t=0 (or an "
        "initial_state(x) method); a value computed from parameters at each call "
        "(self.beta = torch.sigmoid(raw)) goes in a local variable or a parametrization "
        "(torch.nn.utils.parametrize.register_parametrization)" + (_ADDED if added else ""),
    )


#: the way out for a list or dict that a forward only adds to (a recorder, a lazy cache)
_ADDED = (
    ". Its forward added entries to a list or dict it holds: to record values, register a "
    "forward hook on the layer (layer.register_forward_hook: it runs at each step spikeckpt "
    "computes, the recomputed ones too; or return the values from the model); a cache "
    "filled at the first call is filled in __init__ instead"
)


def _only_added(before: Any, after: Any) -> bool:
    """Whether two `_value_key`s of one container differ only by entries added (a list
    appended to, a dict given a new key), none changed or removed."""
    if not (isinstance(before, tuple) and isinstance(after, tuple) and len(before) == 2):
        return False
    if len(after) != 2 or before[0] != after[0] or not isinstance(before[1], tuple):
        return False
    return set(before[1]) < set(after[1])


def positional_params(fn: Callable[..., Any]) -> tuple[list[inspect.Parameter], bool] | None:
    """The positional parameters of ``fn`` (bound: ``self`` excluded) and whether it takes
    ``*args``; ``None`` when the signature cannot be read."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [p for p in sig.parameters.values() if p.kind in kinds]
    star = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values())
    return params, star


def state_arity(module: nn.Module) -> int:
    """How many state arguments ``module.forward`` takes after the input (0: stateless).

    By arity, not by name: ``forward(x, mem)`` and ``forward(x, s1, s2)`` take 1 and 2 (each
    required argument after the first); ``forward(x, state=None)`` takes 1 (an optional second
    argument defaulting to ``None``); ``forward(x)`` and ``forward(x, scale=2.0)`` take 0.
    """
    found = positional_params(module.forward)
    if found is None:
        return 0
    params, _ = found
    required = [p for p in params if p.default is inspect.Parameter.empty]
    if len(required) >= 2:
        return len(required) - 1
    if len(params) >= 2 and params[1].default is None:
        return 1
    return 0


def _extra_outputs_hint(out: Any, n_state: int, args: str) -> str:
    """For a forward returning more than ``(y, state)`` (Rockpool's ``(y, state, record)``):
    how to keep the extra values as outputs."""
    if not isinstance(out, tuple) or len(out) <= n_state + 1:
        return ""
    return (
        f". To keep more outputs than y (a record of the step), return them with y as one "
        f"output: ((y, record), {args})"
    )


def _optional_states_hint(module: nn.Module, out: Any) -> str:
    """For a forward whose states all default to None (``forward(x, mem1=None, mem2=None)``,
    counted as one state, ``forward(x, state=None)``) returning more: how to say it takes
    several."""
    found = positional_params(module.forward)
    if found is None or not isinstance(out, tuple) or len(out) < 3:
        return ""
    optional = [p.name for p in found[0][1:] if p.default is None]
    if len(optional) < len(out) - 1:
        return ""
    names = optional[: len(out) - 1]
    return (
        f". Arguments after the input that default to None count as one state (forward(x, "
        f"state=None)); for {len(names)} states make them required: forward(x, "
        f"{', '.join(names)}): each starts at zeros (shapes learnt from one call), or as "
        "an initial_state(x_t) method returns them"
    )


def _refuse_states_as_one(
    module: nn.Module, path: str, n_state: int, state: State, err: TypeError
) -> None:
    """Raise naming the fix when ``forward(x, v=None, a=None)`` (one state, by arity) failed
    on the tuple its ``initial_state(x)`` returned, handed to it as that one state."""
    if n_state != 1 or not isinstance(state, tuple) or len(state) < 2:
        return
    hint = _optional_states_hint(module, (None, *state))
    if hint:
        raise unsupported(
            module,
            path,
            f"its forward failed ({type(err).__name__}: {err}) when called forward(x, state) "
            f"with the {len(state)} states its initial_state(x) returns as that one state"
            f"{hint}",
        ) from err


#: why a neuron of yours that changes the state it is given in place cannot be stepped
_STATE_IN_PLACE = (
    "its forward changes the state it is given in place (mem.mul_(beta), mem += x, "
    "mem[...] = ...): a checkpointed run hands the same stored state to a step again when "
    "it recomputes it (and the shape probe's zeros to step 0), so the state would be the "
    "changed one (before 2026-11-29: other outputs than your loop's with plan=BPTT(), "
    "torch's 'a leaf Variable that requires grad is being used in an in-place operation' "
    "otherwise); compute a new tensor instead: mem = mem * beta + x"
)


def _zeros_like_tree(tree: Any) -> Any:
    return tree_map(lambda t: torch.zeros_like(t) if isinstance(t, Tensor) else t, tree)


class StatefulAdapter(LayerAdapter):
    """A module with ``forward(x, state) -> (y, state)`` or ``forward(x, s1, ..., sk) ->
    (y, s1, ..., sk)`` (recognised by arity). State: the single state, or the tuple
    ``(s1, ..., sk)``."""

    returns_state = True

    def __init__(self, module: nn.Module, path: str = "", n_state: int | None = None) -> None:
        super().__init__(module, path)
        self.n_state = state_arity(module) if n_state is None else n_state
        if self.n_state < 1:
            self.n_state = 1
        problem = state_order_problem(module.forward, self.n_state)
        if problem is not None:
            raise unsupported(module, path, problem)
        found = positional_params(module.forward)
        params = found[0] if found is not None else []
        #: the module builds its own state from ``None`` (its second argument defaults to None)
        self.accepts_none = self.n_state == 1 and len(params) >= 2 and params[1].default is None
        self._init = next(
            (
                getattr(module, n)
                for n in ("initial_state", "init_state")
                if callable(getattr(module, n, None))
            ),
            None,
        )

    #: attributes the framework writes during a call (`refuse_graph_attributes` skips them)
    written: frozenset[str] = frozenset()

    def check(self) -> None:
        refuse_graph_attributes(self.module, self.path, self.written)

    @property
    def starts_from_none(self) -> bool:
        """Whether the state at t=0 is ``None`` (built by the module at step 0)."""
        return self._init is None and self.accepts_none

    def _call(self, state: State, x_t: Tensor) -> tuple[State, Any]:
        m = self.module
        # the module gets fresh containers: one that assigns into the list or dict it is given
        # (state[0] = ..., as Norse's SequentialState does) must not change a state spikeckpt
        # keeps (the initial state a measuring step ran from, a checkpoint)
        state = fresh_containers(state)
        # an inference tensor (torch.inference_mode: Lightning's validation) has no version
        # counter, and a run without autograd hands no stored state to a recomputed step
        given = [t for t in tree_leaves(state) if isinstance(t, Tensor) and not t.is_inference()]
        versions = [t._version for t in given]
        try:
            out = m(x_t, state) if self.n_state == 1 else m(x_t, *state)
        except TypeError as err:
            _refuse_states_as_one(m, self.path, self.n_state, state, err)
            raise
        if any(t._version != v for t, v in zip(given, versions, strict=True)):
            raise unsupported(m, self.path, _STATE_IN_PLACE)
        if not isinstance(out, tuple) or len(out) != self.n_state + 1:
            got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
            args = (
                "state"
                if self.n_state == 1
                else ", ".join(f"s{i + 1}" for i in range(self.n_state))
            )
            raise unsupported(
                m,
                self.path,
                f"its forward takes {self.n_state} state argument(s) after the input, so it "
                f"must return (y, {args}); it returned {got}. A stateless layer takes the input "
                f"alone: forward(x){_optional_states_hint(m, out)}{_extra_outputs_hint(out, self.n_state, args)}",
            )
        if self.n_state == 1:
            return out[1], out[0]
        return tuple(out[1:]), out[0]

    def init_state(self, x_t: Tensor) -> State:
        if self._init is not None:
            return self._init(x_t)
        if self.accepts_none:
            # checks the (y, state) protocol, and that the forward does not loop over time
            _refuse_an_own_time_loop(self, lambda: probe(self._call, None, x_t), x_t)
            return None
        errors: list[Exception] = []
        # only the shape is learnt: a 0-d zero broadcasts in most neuron updates; then x-shaped
        for z in (x_t.new_zeros(()), torch.zeros_like(x_t)):
            guess = z if self.n_state == 1 else tuple(z for _ in range(self.n_state))
            found = self._zero_state(guess, x_t, errors)
            if found is not None:
                self._refuse_another_start_from_none(found, x_t)
                return _zeros_like_tree(found[0])
        loop = self._own_time_loop()
        if loop is not None:
            raise own_loop_error(
                self.module,
                self.path,
                f"{loop}: it seems to take the whole sequence (one call with a step's input "
                f"{tuple(x_t.shape)} and zero states failed: {errors[-1]!r}), while spikeckpt "
                "calls it once per time step with x[t]",
            ) from errors[-1]
        none_hint = ""
        if self.n_state == 1 and self._steps_from_none(x_t) is not None:
            none_hint = (
                "; it accepts state=None (building its state at step 0, as a loop passing None "
                "runs it): give its state argument the default None, forward(x, state=None), "
                "as Norse's cells do"
            )
        raise unsupported(
            self.module,
            self.path,
            f"it has no initial_state(x) method and calling it with zero states failed "
            f"({errors[-1]!r}){none_hint}; {'or ' if none_hint else ''}give it an "
            "initial_state(x) method, or pass state=... to the wrapped forward",
        ) from errors[-1]

    def _own_time_loop(self) -> str | None:
        """Where the module's forward loops (``for step in range(seq_len)``) over neurons it
        holds, how to say so: a layer of yours written for the whole sequence."""
        code = _code_of(self.module.forward)
        loop = (
            _time_loop(code, code.co_varnames[0] if code.co_argcount else "self") if code else None
        )
        inside: list[str] = []
        tops: list[str] = []
        for name, child in self.module.named_modules():
            if child is self.module or state_arity(child) < 1:
                continue
            if not any(name.startswith(top + ".") for top in tops):  # not one inside another
                tops.append(name)
                inside.append(f"{name} ({type(child).__name__})")
        if loop is None or not inside:
            return None
        return f"{loop}, running the neurons it holds ({', '.join(inside[:4])}) in that loop"

    def _zero_state(
        self, guess: State, x_t: Tensor, errors: list[Exception]
    ) -> tuple[State, Any] | None:
        """The (state, y) of one probed step from ``guess``, or None where it does not fit.
        A state returned in another structure than the guess (a tensor given, a tuple back:
        ``v, i = state`` unpacked the guess along its first axis, the batch) is probed again
        from zeros in the returned structure: the first fit was a coincidence of shapes
        (batch 2 for a 2-tuple)."""
        for _ in range(2):
            try:
                s, y = probe(self._call, guess, x_t)
            except UnsupportedLayerError:
                raise
            except Exception as err:  # the guess does not fit the module
                errors.append(err)
                return None
            if tree_structure(s) == tree_structure(guess):
                return s, y
            guess = _zeros_like_tree(s)
        errors.append(ValueError("the state it returns changes structure from step to step"))
        return None

    def _steps_from_none(self, x_t: Tensor) -> tuple[State, Any] | None:
        """The (state, y) of one probed step from ``state=None`` (each state None, for
        several), or None where it fails."""
        nones = None if self.n_state == 1 else (None,) * self.n_state
        try:
            return cast(tuple[State, Any], probe(self._call, nones, x_t))
        except UnsupportedLayerError:
            raise
        except Exception:  # the module needs a state
            return None

    def _refuse_another_start_from_none(self, from_zeros: tuple[State, Any], x_t: Tensor) -> None:
        """Refuse a module whose state argument has no default but which also steps from
        ``None`` to other values than from zeros: its loop may well pass None at step 0 (Norse's
        convention, ``state: Optional[...]``), and a run started from zeros would then give
        other outputs, silently."""
        from_none = self._steps_from_none(x_t)
        if from_none is None or _same_steps(from_zeros, from_none):
            return
        again = self._steps_from_none(x_t)
        if again is None or not _same_steps(from_none, again):
            # None reads a state the module keeps from its last call (snnTorch's neurons
            # given mem=None): not a start of its own, and its loop passes the states
            return
        if self.n_state == 1:
            problem = (
                "its state argument has no default, so its state would start as zeros, but "
                "called with state=None it builds another state at step 0 (one step from None "
                "returns other values than one from zeros): say which start your loop uses. "
                "Give the state argument the default None, forward(x, state=None), to start "
                "from None as Norse's cells do; or an initial_state(x) method returning the "
                "state to start from, or pass state=... to the wrapped forward"
            )
        else:
            problem = (
                f"its {self.n_state} state arguments would start as zeros, but called with "
                "None for each it builds other states at step 0 (one step from None returns "
                "other values than one from zeros): say which start your loop uses. Give it an "
                f"initial_state(x) method returning the {self.n_state} states your loop starts "
                "from (it is called with the first step's input), or pass state=... to the "
                "wrapped forward"
            )
        raise unsupported(self.module, self.path, problem)

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        return self._call(state, x_t)


def _same_steps(a: Any, b: Any) -> bool:
    """Whether two probed ``(state, y)`` are equal leaf by leaf (`_same_leaf`)."""
    u, v = tree_leaves(a), tree_leaves(b)
    return len(u) == len(v) and all(_same_leaf(p, q) for p, q in zip(u, v, strict=True))


def _same_leaf(u: Any, v: Any) -> bool:
    """Whether two probed leaves are equal: tensors of one shape and equal values, or equal
    other values (a ``None`` kept in a state)."""
    if isinstance(u, Tensor) or isinstance(v, Tensor):
        return (
            isinstance(u, Tensor)
            and isinstance(v, Tensor)
            and u.shape == v.shape
            and torch.equal(u, v)
        )
    return u is v or type(u) is type(v) and bool(u == v)


def _refuse_an_own_time_loop(adapter: LayerAdapter, call: Callable[[], Any], x_t: Tensor) -> Any:
    """Run ``call`` (one step of ``adapter``'s module of yours) counting the calls of its
    stateful submodules; raise where one was called once per row of ``x_t (B, ...)``, each time
    on a slice of lower rank: the forward loops over its input's first axis itself (``for t in
    range(x.shape[0])``, written for ``x (T, B, ...)``), and given one step ``x_t`` that loop
    would run over the batch, its results not the plain loop's."""
    module = adapter.module
    calls: dict[str, list[int]] = {}
    handles = []
    for name, child in module.named_modules():
        if child is module or state_arity(child) < 1:
            continue

        def count(_: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            first = next((a for a in args if isinstance(a, Tensor)), None)
            calls.setdefault(name, []).append(first.ndim if first is not None else -1)

        handles.append(child.register_forward_pre_hook(count))
    try:
        result = call()
    finally:
        for handle in handles:
            handle.remove()
    rows = int(x_t.shape[0]) if x_t.ndim else 0
    for name, ranks in calls.items():
        if rows > 1 and len(ranks) == rows and all(0 <= r < x_t.ndim for r in ranks):
            child = module.get_submodule(name)
            raise own_loop_error(
                module,
                adapter.path,
                f"in one step its forward called {name} ({type(child).__name__}) {rows} times, "
                f"once per row of the step's input {tuple(x_t.shape)}, each on a slice: it "
                "seems to loop over time itself (for t in range(x.shape[0])), and spikeckpt "
                "calls it once per step with x[t] (B, ...), so that loop would run over the "
                "batch",
            )
    return result


class RNNCellAdapter(LayerAdapter):
    """``nn.RNNCell`` / ``nn.GRUCell``: state ``h (B, H)``; ``nn.LSTMCell``: ``(h, c)``."""

    def init_state(self, x_t: Tensor) -> State:
        m = cast(nn.RNNCellBase, self.module)  # RNNCell, GRUCell or LSTMCell
        h = torch.zeros(x_t.shape[0], m.hidden_size, dtype=x_t.dtype, device=x_t.device)
        return (h, h.clone()) if isinstance(m, nn.LSTMCell) else h

    def coerce_state(self, state: State, x_t: Tensor) -> State:
        """A given state: ``h`` (``(h, c)`` for ``nn.LSTMCell``) of this call's batch and
        the cell's ``hidden_size``; another shape is refused naming the layer (torch's own
        message named neither the layer nor the way forward)."""
        m = cast(nn.RNNCellBase, self.module)
        lstm = isinstance(m, nn.LSTMCell)
        parts = list(state) if lstm and isinstance(state, tuple | list) else [state]
        want = (x_t.shape[0], m.hidden_size) if x_t.dim() == 2 else (m.hidden_size,)
        names = ("h", "c") if lstm else ("h",)
        if len(parts) != len(names) or not all(
            isinstance(p, Tensor) and tuple(p.shape) == want for p in parts
        ):
            got = ", ".join(
                str(tuple(p.shape)) if isinstance(p, Tensor) else type(p).__name__ for p in parts
            )
            raise ConfigError(
                f"state= for layer {self.path or '<root>'} ({type(m).__name__}): its state is "
                f"{' and '.join(names)}, each {want} for this call's input {tuple(x_t.shape)}, "
                f"got {got}; pass None for this layer (zeros) or "
                f"{'(h, c)' if lstm else 'h'} of shape {want} (a previous batch's final state "
                "sliced to this batch)"
            )
        return (parts[0], parts[1]) if lstm else parts[0]

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        if isinstance(self.module, nn.LSTMCell):
            h, c = self.module(x_t, tuple(state))
            return (h, c), h
        h = self.module(x_t, state)
        return h, h

    def membrane(self, state: State) -> Tensor | None:
        return state[0] if isinstance(state, tuple) else state


# ----------------------------------------------------------------------------- your own modules

_OWN_LOOP_ROUTE = """\
A model with its own time loop: move the loop body into a step function and let
spikeckpt.scan run the loop (parameters are found on the step's self and closure;
initial states stay as you write them: init_leaky(), None, initial_state(x)):

    def forward(self, x):                          # x: (T, B, ...), x[t] at step t
        state = (self.lif1.init_leaky(), self.lif2.init_leaky())   # or (None, None) in Norse
        def step(state, x_t):                      # the body of your loop
            mem1, mem2 = state
            spk1, mem1 = self.lif1(self.fc1(x_t), mem1)
            spk2, mem2 = self.lif2(self.fc2(spk1), mem2)
            return (mem1, mem2), (spk2, mem2)      # (new state, what you recorded)
        (spk2, mem2), _ = spikeckpt.scan(step, x, state, plan=spikeckpt.plans.Revolve(8))
        return spk2, mem2                          # each (T, B, ...), like torch.stack(rec)

If your loop feeds the same x (B, ...) at every step (snnTorch tutorial 5:
`for step in range(num_steps): cur1 = self.fc1(x)`), say so, or scan runs over x's
batch axis: spikeckpt.scan(step, x, state, steps=self.num_steps, plan=...) feeds x at
each of num_steps steps (or pass x.expand(num_steps, *x.shape): a view, no copy).

or build it as an nn.Sequential / Norse SequentialState of its layers and wrap that
(see the "Bring your own model" page of the docs)."""


def own_loop_error(module: nn.Module, path: str, why: str) -> UnsupportedLayerError:
    """The error for a module that runs its own time loop, showing the way to [`scan`][spikeckpt.engine.scan.scan]."""
    return unsupported(module, path, f"{why}.\n{_OWN_LOOP_ROUTE}")


def _code_of(fn: Any) -> types.CodeType | None:
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__code__", None)


def _lines(instrs: list[dis.Instruction]) -> list[int | None]:
    """The source line of each instruction (Python 3.10 to 3.13 spell it differently)."""
    out: list[int | None] = []
    current: int | None = None
    for ins in instrs:
        line = getattr(ins, "line_number", None)
        if line is None:
            pos = getattr(ins, "positions", None)
            line = getattr(pos, "lineno", None)
        if (
            line is None
            and isinstance(ins.starts_line, int)
            and not isinstance(ins.starts_line, bool)
        ):
            line = ins.starts_line
        current = line if line is not None else current
        out.append(current)
    return out


def _names(argval: Any) -> tuple[str, ...]:
    if isinstance(argval, str):
        return (argval,)
    if isinstance(argval, tuple):
        return tuple(a for a in argval if isinstance(a, str))
    return ()


def _time_loop(code: types.CodeType, self_name: str, depth: int = 0) -> str | None:
    """Describe a loop in ``code`` that is not over the module's own attributes (``for layer
    in self.layers``), or ``None``: ``while`` loops, ``for ... in range(...)``, loops over an
    argument or a local variable (``for x_t in x``, ``for t in ...``)."""
    instrs = list(dis.get_instructions(code))
    lines = _lines(instrs)
    by_offset = {ins.offset: ins for ins in instrs}
    for i, ins in enumerate(instrs):
        if ins.opname == "GET_ITER":
            loads = []
            j = i - 1
            while j >= 0 and lines[j] == lines[i] and lines[i] is not None:
                loads.append(instrs[j])
                j -= 1
            for load in loads:
                if load.opname in ("LOAD_GLOBAL", "LOAD_NAME") and "range" in _names(load.argval):
                    return "its forward loops over range(...)"
            for load in loads:
                names = _names(load.argval)
                if load.opname.startswith(("LOAD_FAST", "LOAD_DEREF")) and any(
                    n != self_name and not n.startswith(".") for n in names
                ):
                    return f"its forward loops over {names[0]!r}"
        elif "JUMP" in ins.opname and isinstance(ins.argval, int) and ins.argval < ins.offset:
            target = by_offset.get(ins.argval)
            k = instrs.index(target) if target is not None else -1
            if k >= 0 and "FOR_ITER" not in {x.opname for x in instrs[k : k + 2]}:
                return "its forward has a while loop"
    if depth < 2:
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found = _time_loop(const, self_name, depth + 1)
                if found:
                    return found
    return None


def _loop_in_methods(
    code: types.CodeType, self_name: str, cls: type, seen: frozenset[str] = frozenset()
) -> str | None:
    """Describe a time loop in a method of ``cls`` that ``code`` calls on ``self``
    (SpikingJelly's ``forward`` hands a whole sequence to ``self.multi_step_forward``, whose
    loop runs over time), two calls deep, or ``None``. Methods of torch's classes are not
    looked into."""
    instrs = list(dis.get_instructions(code))
    for prev, ins in zip(instrs, instrs[1:], strict=False):
        if ins.opname not in ("LOAD_METHOD", "LOAD_ATTR") or not isinstance(ins.argval, str):
            continue
        if not prev.opname.startswith("LOAD_FAST") or prev.argval != self_name:
            continue
        name = ins.argval
        fn = inspect.getattr_static(cls, name, None)
        fn = getattr(fn, "__func__", fn)  # a staticmethod / classmethod: its function
        inner = getattr(fn, "__code__", None)
        if name in seen or not isinstance(fn, types.FunctionType) or inner is None:
            continue
        if (fn.__module__ or "").split(".")[0] == "torch":
            continue
        inner_self = inner.co_varnames[0] if inner.co_argcount else self_name
        found = _time_loop(inner, inner_self)
        if found:
            return f"{found} (in self.{name}, which its forward calls)"
        if len(seen) < 1:
            found = _loop_in_methods(inner, inner_self, cls, seen | {name})
            if found:
                return found
    return None


def _foreign(module: nn.Module) -> bool:
    """Whether the module's class is not one of torch's own (a class of yours or a package's)."""
    return (own_class(module).__module__ or "").split(".")[0] != "torch"


def _stateful_descendants(
    module: nn.Module, adapter_for: AdapterFor
) -> list[tuple[str, LayerAdapter | None]]:
    """The layers inside ``module`` that keep state over time (neurons, cells): their paths
    and adapters (``None`` for a layer no adapter steps that may be one)."""
    found: list[tuple[str, LayerAdapter | None]] = []
    for name, sub in module.named_modules(remove_duplicate=True):
        if sub is module:
            continue
        try:
            adapter = adapter_for(sub, name)
        except UnsupportedLayerError:
            if _foreign(sub):  # a framework's or your layer that cannot be stepped: maybe a neuron
                found.append((f"{name} ({type(sub).__name__})", None))
            continue  # torch's own layers hold no state between calls (nn.LSTM restarts)
        if adapter.stateful and not hasattr(adapter, "layers") and not hasattr(adapter, "neurons"):
            found.append((f"{name} ({type(sub).__name__})", adapter))
    return found


def _holds_state_itself(adapter: LayerAdapter | None) -> bool:
    """Whether a neuron keeps its state on the module and can have it set and read
    (snnTorch ``init_hidden=True``: ``put_state`` / ``take_state``)."""
    return (
        adapter is not None
        and adapter.state_on_module
        and callable(getattr(adapter, "put_state", None))
        and callable(getattr(adapter, "take_state", None))
    )


class HiddenStateAdapter(LayerAdapter):
    """A module of yours with ``forward(x)`` whose neurons keep their state on themselves
    (snnTorch ``init_hidden=True``), called once per time step, as in::

        class Block(nn.Module):
            def forward(self, x):
                return self.lif(self.bn(self.conv(x)))

    State: the tuple of its neurons' states. Each step sets them on the neurons, calls the
    module, reads them back and clears the neurons; the state at t=0 is zeros, what snnTorch
    starts from after ``utils.reset`` (found with one shape probe).

    Attributes:
        neurons: the neurons' adapters (``put_state`` / ``take_state`` / ``cleanup``).
    """

    state_on_module = True

    def __init__(self, module: nn.Module, path: str, neurons: Sequence[LayerAdapter]) -> None:
        super().__init__(module, path)
        self.neurons = list(neurons)
        self._stats = [m for m in module.modules() if isinstance(m, RUNNING_STATS_TYPES)]
        #: what the neurons' adapters assign on their modules: theirs to manage
        self._managed = frozenset(a for n in self.neurons for a in getattr(n, "managed", ()))

    def init_state(self, x_t: Tensor) -> State:
        def run(x: Tensor) -> tuple[Any, ...]:
            self.cleanup()  # empty states: each neuron starts from zeros at its first call
            with frozen_running_stats(self._stats):
                self.module(x)
            return tuple(_zeros_like_tree(n.take_state()) for n in self.neurons)  # type: ignore[attr-defined]

        try:
            return probe(run, x_t)
        finally:
            self.cleanup()

    def step(self, state: State, x_t: Tensor) -> tuple[State, Any]:
        # anything assigned on the block beside what its neurons' adapters manage (a spike
        # count kept for a rate regulariser) is state kept on it: refused
        with refuse_kept_state(self.module, self.path, self._managed):
            return self._step(state, x_t)

    def _step(self, state: State, x_t: Tensor) -> tuple[State, Any]:
        try:
            for neuron, s in zip(self.neurons, state, strict=True):
                neuron.put_state(s)  # type: ignore[attr-defined]
            if self._stats and _side_effects_off():
                with frozen_running_stats(self._stats):
                    y = self.module(x_t)
            else:
                y = self.module(x_t)
            new = tuple(neuron.take_state() for neuron in self.neurons)  # type: ignore[attr-defined]
        finally:
            self.cleanup()
        return new, y

    def cleanup(self) -> None:
        for neuron in self.neurons:
            neuron.cleanup()


class UsersStatefulAdapter(StatefulAdapter):
    """A neuron of yours, ``forward(x, state) -> (y, state)``: each step checks that it keeps
    nothing more on itself (``self.a = 0.9 * self.a + spk.detach()``, ``self.beta =
    torch.sigmoid(raw)``), refused naming it: a recomputed step would read the value the
    last step left there (before 2026-11-29 such a detached adaptation ran, its gradients
    26-98% off the loop's, silently; one with a graph failed in the backward pass)."""

    def __init__(self, module: nn.Module, path: str = "", n_state: int | None = None) -> None:
        super().__init__(module, path, n_state)
        #: what framework neurons inside it write on themselves (snnTorch's ``mem``, ``reset``)
        self._managed = frozenset().union(*(_written_by(m) for m in module.modules()))

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        with refuse_kept_state(self.module, self.path, self._managed):
            return super().step(state, x_t)


def _custom_factory(adapter_for: AdapterFor) -> Callable[[nn.Module, str], LayerAdapter]:
    def factory(module: nn.Module, path: str) -> LayerAdapter:
        n = state_arity(module)
        if n:
            return UsersStatefulAdapter(module, path, n)
        code = _code_of(module.forward)
        self_name = code.co_varnames[0] if code and code.co_argcount else "self"
        loop = (
            _time_loop(code, self_name) or _loop_in_methods(code, self_name, type(module))
            if code
            else None
        )
        stateful = _stateful_descendants(module, adapter_for)
        if stateful and not loop and all(_holds_state_itself(a) for _, a in stateful):
            return HiddenStateAdapter(module, path, [a for _, a in stateful if a is not None])
        if stateful:
            names = ", ".join(name for name, _ in stateful[:4])
            names += ", ..." if len(stateful) > 4 else ""
            raise own_loop_error(
                module,
                path,
                f"its forward(x) runs layers that keep state over time ({names}), so one call "
                "is not one time step of a layer spikeckpt can step (only neurons that keep "
                "their state on themselves, snnTorch init_hidden=True, can be stepped inside "
                "a forward(x) without a loop)",
            )
        if loop:
            raise own_loop_error(
                module,
                path,
                f"{loop}; spikeckpt steps a layer one time step per call (if the loop "
                "is not over time, register it: register_adapter(lambda m: isinstance(m, "
                f"{type(module).__name__}), StatelessAdapter))",
            )
        return CustomLayerAdapter(module, path)

    return factory


def _is_stateless(m: nn.Module) -> bool:
    return isinstance(m, STATELESS_TYPES)


def _is_rnn_cell(m: nn.Module) -> bool:
    return isinstance(m, (nn.RNNCell, nn.GRUCell, nn.LSTMCell))


def _is_rnn(m: nn.Module) -> bool:
    return isinstance(m, nn.RNNBase)


def _rnn_error(m: nn.Module, path: str) -> LayerAdapter:
    raise unsupported(
        m,
        path,
        "nn.RNN/GRU/LSTM run whole sequences; use nn.RNNCell, "
        "nn.GRUCell or nn.LSTMCell (one step per call) instead",
    )


def _is_generic(m: nn.Module) -> bool:
    return _foreign(m) and state_arity(m) > 0


def _is_custom(m: nn.Module) -> bool:
    if isinstance(m, nn.Sequential):  # a forward of its own or hooks (else: a stack)
        return not plain_container(m, nn.Sequential.forward)
    return _foreign(m) and not isinstance(m, (nn.ModuleList, nn.ModuleDict))


def registrations(adapter_for: AdapterFor) -> list[Registration]:
    """The built-in entries of this module; ``adapter_for`` (the registry's lookup) classifies
    the submodules of your own modules."""
    return [
        Registration(
            _is_stateless,
            StatelessAdapter,
            "stateless torch.nn layers",
            "Linear, Conv*, Flatten, Unflatten, Dropout*, pooling, padding, Identity, "
            "activations, LayerNorm, GroupNorm, BatchNorm*/InstanceNorm* (training mode: "
            "running statistics updated once per step), Upsample, Embedding",
        ),
        Registration(
            _is_rnn_cell,
            RNNCellAdapter,
            "torch.nn RNN cells",
            "nn.RNNCell, nn.GRUCell, nn.LSTMCell",
        ),
        Registration(_is_rnn, _rnn_error, "torch.nn sequence RNNs"),
        Registration(
            _is_generic,
            UsersStatefulAdapter,
            "your neurons",
            "any module of yours with forward(x, state) -> (y, state) or forward(x, s1, ..., "
            "sk) -> (y, s1, ..., sk), by arity (initial state from its initial_state(x) "
            "method, else None when the state argument defaults to None, else zeros)",
        ),
        Registration(
            _is_custom,
            _custom_factory(adapter_for),
            "your stateless layers",
            "any module of yours with forward(x) and no state (no neurons inside, no time "
            "loop, nothing assigned on self in forward)",
        ),
    ]
