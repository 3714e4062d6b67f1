"""``wrap``'s option checks: each option is checked once, at wrap time, with a message that
names the fix."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from numbers import Integral
from typing import Any, cast

from torch import Tensor, nn

from spikeckpt.engine.compiled import COMPILE_CHOICES, Compile
from spikeckpt.engine.inputs import is_packed
from spikeckpt.engine.readout import check_readout
from spikeckpt.errors import ConfigError, ConfigTypeError
from spikeckpt.plans.base import Plan
from spikeckpt.plans.schedule import Schedule

__all__ = [
    "GRANULARITIES",
    "check_compile",
    "check_granularity",
    "check_input",
    "check_model",
    "check_options",
    "check_params",
    "check_plan",
    "refuse_integer_input",
    "refuse_unbatched",
]

GRANULARITIES = ("stack", "layer", "auto")


def check_model(model: Any, wrapped: bool) -> None:
    """``wrap``'s model: an ``nn.Module`` instance, not wrapped yet (``wrapped``)."""
    if wrapped:
        raise ConfigTypeError("model is already wrapped; use spikeckpt.unwrap(seq) to get it back")
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise ConfigTypeError(
            f"model is the class {model.__name__}, not a model: wrap an instance, "
            f"spikeckpt.wrap({model.__name__}(...))"
        )
    if not isinstance(model, nn.Module):
        raise ConfigTypeError(
            f"model must be an nn.Module (an nn.Sequential, a neuron, a module of yours), got "
            f"{type(model).__name__}; a step function runs through spikeckpt.scan(step, x, state)"
        )


def check_input(x: Any) -> Any:
    """A wrapped model's input: a tensor ``(T, B, ...)`` or a packed train, else refused with
    the fix (a list of steps, as some loops collect them, is stacked first)."""
    if isinstance(x, Tensor) or is_packed(x):
        return x
    hint = ""
    if isinstance(x, (list, tuple)) and x and all(isinstance(t, Tensor) for t in x):
        hint = f"; a {type(x).__name__} of {len(x)} per-step tensors: pass torch.stack(x)"
    raise ConfigTypeError(
        f"x must be a tensor (T, B, ...) (or (B, T, ...) with batch_first=True) or a packed "
        f"spikeckpt.SpikeTrain, got {type(x).__name__}{hint}"
    )


def check_plan(plan: Any) -> None:
    """One rule for ``plan`` at wrap time: a plan object, a ``Schedule`` or ``"auto"``."""
    if isinstance(plan, (Plan, Schedule)) or (isinstance(plan, str) and plan == "auto"):
        return
    raise ConfigError(
        f"plan must be a plan object (spikeckpt.plans.BPTT(), Uniform(10), Revolve(8), "
        f"Double(), ...), a Schedule or 'auto', got {plan!r}"
    )


def check_params(params: Sequence[Tensor] | None) -> list[Tensor]:
    """``wrap(..., params=...)``: a sequence of tensors (those requiring grad are kept)."""
    if params is None:
        return []
    if isinstance(params, Tensor) or not isinstance(params, Iterable):
        raise ConfigTypeError(
            f"params must be a list of tensors (params=[tensor, ...]), got {type(params).__name__}"
        )
    params = list(params)
    for p in params:
        if not isinstance(p, Tensor):
            raise ConfigTypeError(f"params must be tensors, got a {type(p).__name__} in the list")
    return params


def check_options(granularity: str, readout: Any, chunk: int | None, pack_tape: bool) -> None:
    """Every option runs in the granularity asked for, or is refused here."""
    check_readout(readout)
    if chunk is not None and (
        isinstance(chunk, bool) or not isinstance(chunk, Integral) or chunk < 1
    ):
        raise ConfigError(f"chunk must be a whole number of steps >= 1 (or None), got {chunk!r}")
    if callable(readout) and granularity == "layer":
        raise ConfigError(
            "granularity='layer' supports the named readouts; a callable readout needs "
            "granularity='stack' (or 'auto', which then runs the stack)"
        )
    if chunk is not None and granularity == "stack":
        raise ConfigError(
            f"chunk={chunk} is the layer-wise chunk; granularity='stack' has none: use "
            "granularity='layer' (or 'auto'), or a stack plan such as Uniform(k)"
        )
    if pack_tape and granularity != "stack":
        raise ConfigError(
            f"pack_tape=True packs the stack granularity's tape; granularity={granularity!r} "
            "may run layer-wise, which keeps one block's chunk taped and stores its spike "
            "trains packed already: use granularity='stack' with pack_tape=True"
        )


def check_granularity(granularity: str) -> str:
    if granularity not in GRANULARITIES:
        raise ConfigError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    return granularity


def check_compile(choice: Any) -> Compile:
    if choice not in COMPILE_CHOICES or not isinstance(choice, (bool, str)):
        raise ConfigError(f"compile must be True, False or 'auto', got {choice!r}")
    return cast(Compile, choice)  # a bool, or the one string choice: 'auto'


def _first_layer(model: nn.Module) -> nn.Module:
    """The layer an ``nn.Sequential`` (or a Norse ``SequentialState``) runs first."""
    while isinstance(model, nn.Sequential) and len(model) > 0:
        model = model[0]
    return model


#: layers that only reshape: an integer input stays integer through them
_RESHAPES = (nn.Flatten, nn.Unflatten, nn.Identity)


def _first_weighted_layer(model: nn.Module) -> nn.Module:
    """The first layer of an ``nn.Sequential`` (nested ones too) that is not a reshape
    (``Flatten``, ``Unflatten``, ``Identity``): where an input's dtype first meets weights."""
    layers: list[nn.Module] = [model]
    while layers:
        first = layers.pop(0)
        if isinstance(first, nn.Sequential):
            layers[:0] = list(first)
        elif not isinstance(first, _RESHAPES):
            return first
    return model


def refuse_integer_input(model: nn.Module, x: Any) -> None:
    """An integer or bool input to a first ``Linear`` or convolution with floating weights
    (tonic's ``ToFrame`` gives ``int16`` event counts; a train packed from ``x.bool()``
    unpacks to ``bool``): torch's dtype error comes from deep inside the run and does not say
    to cast. ``x`` is dense or packed (a ``SpikeTrain``: its ``dtype`` is the one it unpacks to).
    Leading reshapes (``nn.Flatten()`` before the first ``Linear``) are looked through."""
    first = _first_weighted_layer(model)
    weight = getattr(first, "weight", None)
    packed = is_packed(x)
    if not (packed or isinstance(x, Tensor)):
        return
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return
    if not isinstance(first, nn.Linear | nn.modules.conv._ConvNd):
        return
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        return
    fix = (
        f"pack a {weight.dtype} train (SpikeTrain.from_dense(dense.to({weight.dtype})), or "
        "sparse.float() for a torch.sparse_coo train)"
        if packed
        else f"pass x.float() (or x.to({weight.dtype})); tonic's ToFrame gives int16 event counts"
    )
    what = "the packed train x unpacks to" if packed else "x is"
    raise ConfigTypeError(
        f"{what} {x.dtype} and the first layer ({type(first).__name__}) computes in "
        f"{weight.dtype}: {fix}"
    )


def refuse_unbatched(model: nn.Module, x: Any, batch_first: bool) -> None:
    """A 2-D input whose second axis is the first ``nn.Linear``'s features has no batch axis:
    its steps ``x[t]`` would run unbatched, one sample per step, and the outputs would look
    plausible. Most often it is a static input ``(B, features)`` meant for every step."""
    first = _first_layer(model)
    if isinstance(first, nn.modules.conv._ConvNd):
        _refuse_unbatched_image(first, x, batch_first)
        return
    if len(x.shape) != 2 or not isinstance(first, nn.Linear):
        return
    if int(x.shape[1]) != first.in_features:
        return
    T, features = int(x.shape[0]), int(x.shape[1])
    axes = "(B, T)" if batch_first else "(T, B)"
    raise ConfigError(
        f"x has shape {tuple(x.shape)}: read as {axes} it has no feature axis, and its "
        f"{features} columns are the first Linear's in_features, so each step would run one "
        f"unbatched sample. A static input (B, {features}) fed at every step (snnTorch "
        f"tutorial 5): pass x.expand(num_steps, *x.shape) (a view, no copy); a sequence of "
        f"one sample: x[:, None] (T={T}, B=1, {features})"
    )


def _refuse_unbatched_image(first: nn.modules.conv._ConvNd, x: Any, batch_first: bool) -> None:
    """An input with one axis too few for the first convolution, whose second axis is its
    ``in_channels``: a static image ``(B, C, H, W)`` (snnTorch tutorial 6) read as ``(T, B,
    ...)`` runs each sample unbatched as one step (torch's convolutions accept ``(C, H, W)``),
    and fails later with a shape error that names neither."""
    spatial = len(first.kernel_size)
    if len(x.shape) != spatial + 2 or int(x.shape[1]) != first.in_channels:
        return
    axes = "(B, T, C, ...)" if batch_first else "(T, B, C, ...)"
    shape = tuple(x.shape)
    raise ConfigError(
        f"x has shape {shape}: read as {axes} each step would be one unbatched sample of "
        f"{tuple(shape[1:])} for the first {type(first).__name__} (in_channels="
        f"{first.in_channels}). A static input {shape} fed at every step (snnTorch tutorial "
        f"6): pass x.expand(num_steps, *x.shape) (a view, no copy); a sequence of one "
        f"sample: x[:, None]"
    )
