"""Whether the engine is recomputing steps, and the one freezer of running statistics.

The engine evaluates every step once in the forward phase and again, some steps several
times, while it recomputes in the backward phase. A layer that updates something outside its
outputs on each call (``BatchNorm``'s running statistics) must do so only in the first
evaluation: it asks `recomputing`, which is ``True`` inside `recompute_phase`
(the engine enters it for its whole backward phase).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any, cast

from torch import nn

from spikeckpt.errors import UnsupportedLayerError

__all__ = [
    "RUNNING_STATS_TYPES",
    "frozen_running_stats",
    "guard_running_stats",
    "in_backward",
    "recompute_phase",
    "recomputing",
    "refuse_power_iteration",
    "uncached_parametrizations",
]

_RECOMPUTING: ContextVar[bool] = ContextVar("spikeckpt_recomputing", default=False)
_BACKWARD: ContextVar[bool] = ContextVar("spikeckpt_backward", default=False)


def recomputing() -> bool:
    """``True`` while the engine re-evaluates steps it already ran in the forward phase."""
    return _RECOMPUTING.get()


def in_backward() -> bool:
    """``True`` inside the engine's backward phase (``recompute_phase(backward=True)``); a
    probe's forward pass is `recomputing` (it changes nothing) but holds what the forward
    pass holds."""
    return _BACKWARD.get()


@contextlib.contextmanager
def recompute_phase(*, backward: bool = False) -> Iterator[None]:
    """Mark the code inside as recomputation (the engine's backward phase with ``backward``,
    else a probe); parametrized weights are computed afresh at each access there
    (`uncached_parametrizations`: a backward inside ``parametrize.cached()`` would otherwise
    reuse one recomputed segment's weight, and its freed graph, in the next)."""
    token = _RECOMPUTING.set(True)
    mark = _BACKWARD.set(True) if backward else None
    try:
        with uncached_parametrizations():
            yield
    finally:
        if mark is not None:
            _BACKWARD.reset(mark)
        _RECOMPUTING.reset(token)


# ----------------------------------------------------------------------------- running stats

#: Layers that update running statistics in training mode (``track_running_stats=True``).
RUNNING_STATS_TYPES: tuple[type, ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)
_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _set_aside(m: nn.Module) -> dict[str, Any] | None:
    """Stop a training-mode layer from updating its running statistics: BatchNorm (and
    ``SyncBatchNorm``) with ``track_running_stats`` off, InstanceNorm with its statistics
    buffers set aside (``None``); returns what `_put_back` restores (None: nothing)."""
    if not (m.training and getattr(m, "track_running_stats", False)):
        return None
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        m.track_running_stats = False
        return {"track_running_stats": True}
    kept = {k: m._buffers[k] for k in _STAT_BUFFERS if m._buffers.get(k) is not None}
    for k in kept:
        m._buffers[k] = None
    return kept


def _put_back(m: nn.Module, kept: dict[str, Any] | None) -> None:
    """Undo `_set_aside`."""
    if kept and "track_running_stats" in kept:  # set aside from a _BatchNorm
        cast(nn.modules.batchnorm._BatchNorm, m).track_running_stats = True
    elif kept:
        m._buffers.update(kept)


@contextlib.contextmanager
def frozen_running_stats(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Inside, BatchNorm/InstanceNorm layers in training mode do not update their running
    statistics (put back on exit). In training mode these layers normalise with the batch's
    own statistics, so outputs and gradients are the same (bitwise) as with them tracked."""
    saved: list[tuple[nn.Module, dict[str, Any] | None]] = []
    try:
        for m in modules:
            if isinstance(m, RUNNING_STATS_TYPES):
                saved.append((m, _set_aside(m)))
        yield
    finally:
        for m, kept in reversed(saved):
            _put_back(m, kept)


def guard_running_stats(modules: Sequence[nn.Module]) -> None:
    """Give every BatchNorm/InstanceNorm layer among ``modules`` a pair of forward hooks (once)
    that keep its running statistics out of recomputed calls: while the engine recomputes
    (`recomputing`), a training-mode call runs frozen (`frozen_running_stats`'s rule), so
    the statistics are updated once per step, in the forward phase, as in the plain loop."""
    for m in modules:
        if isinstance(m, RUNNING_STATS_TYPES) and not m.__dict__.get("_spikeckpt_guarded", False):
            m.register_forward_pre_hook(_stats_aside)
            m.register_forward_hook(_stats_back, always_call=True)
            m.__dict__["_spikeckpt_guarded"] = True


def _stats_aside(module: nn.Module, args: Any) -> None:
    """Forward pre-hook: while recomputing, set the running statistics aside."""
    kept = _set_aside(module) if recomputing() else None
    module.__dict__.setdefault("_spikeckpt_kept", []).append(kept)


def _stats_back(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook (always called): put back what `_stats_aside` set aside."""
    stack = module.__dict__.get("_spikeckpt_kept")
    _put_back(module, stack.pop() if stack else None)


# ----------------------------------------------------------------------------- spectral norm


def _power_iterating(m: nn.Module) -> bool:
    """Whether ``m`` is a spectral norm that runs a power iteration on each call (training
    mode): ``nn.utils.parametrizations.spectral_norm``'s parametrization, or the module of the
    older ``nn.utils.spectral_norm`` (a forward pre-hook)."""
    if not m.training:
        return False
    if type(m).__name__ == "_SpectralNorm" and hasattr(m, "_u"):
        return True
    return any(type(h).__name__ == "SpectralNorm" for h in m._forward_pre_hooks.values())


def refuse_power_iteration(modules: Sequence[nn.Module]) -> None:
    """Refuse a training-mode spectral norm among ``modules``: its power iteration updates
    the ``u``/``v`` buffers at every weight access, so each step of the plain loop uses other
    ones, and a recomputed step (or one evaluated apart) would use, and update, others again:
    gradients off by round-off-sized amounts and buffers unlike the loop's, silently."""
    for m in modules:
        if _power_iterating(m):
            raise UnsupportedLayerError(
                f"{type(m).__name__} in training mode: spectral_norm runs a power iteration "
                "at every weight access (its u, v buffers change at every step), which steps "
                "recomputed in the backward pass cannot replay. Put it in eval mode for the "
                "wrapped call (e.g. net[0].parametrizations.weight[0].eval(): u, v stay "
                "fixed, exact), and run the power iteration yourself between batches "
                "(train(), read net[0].weight under torch.no_grad(), eval() again)"
            )


@contextlib.contextmanager
def uncached_parametrizations() -> Iterator[None]:
    """Inside, ``torch.nn.utils.parametrize.cached()`` is off: a parametrized weight
    (``weight_norm``, ``orthogonal``, ...) is computed at each access, inside each step. A
    weight cached outside the run is not an input of the run's Function: the gradients of
    the steps taped in the forward pass would never reach its parameters (they were lost,
    silently). Each step computes the weight from its parameters instead, as the uncached
    loop does (the cached loop's gradients up to float round-off)."""
    from torch.nn.utils import parametrize

    enabled = parametrize._cache_enabled
    parametrize._cache_enabled = 0
    try:
        yield
    finally:
        parametrize._cache_enabled = enabled
