"""Adapters for plain ``torch.nn`` layers and for any ``forward(x, state) -> (y, state)`` module.

- :class:`StatelessAdapter`: Linear, Conv, Flatten, Dropout, pooling, padding, activations,
  LayerNorm/GroupNorm, Identity, ... : state ``()``, ``y_t = module(x_t)``. BatchNorm and
  InstanceNorm are stateless only when they do not update running statistics (``eval()`` mode or
  ``track_running_stats=False``): recomputation would update them twice, so training mode with
  running statistics raises :class:`~spikeckpt.errors.UnsupportedLayerError`.
- :class:`RNNCellAdapter`: ``nn.RNNCell`` / ``nn.GRUCell`` (state ``h``), ``nn.LSTMCell``
  (state ``(h, c)``); ``y_t = h``.
- :class:`StatefulAdapter`: any module whose ``forward`` takes the state as its second argument
  (named ``state``, ``hx``, ``hidden``, ...) and returns ``(y, state)``. The initial state comes
  from the module's ``initial_state(x_t)`` or ``init_state(x_t)`` method when it has one, else it
  is zeros shaped like the state ``module(x_t, None)`` returns.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from spikeckpt.adapters.base import LayerAdapter, Registration, State, unsupported

__all__ = [
    "STATELESS_TYPES",
    "RNNCellAdapter",
    "StatefulAdapter",
    "StatelessAdapter",
    "TimeLiftedAdapter",
    "probe",
]


def _types(*names: str) -> tuple[type, ...]:
    return tuple(getattr(nn, n) for n in names if hasattr(nn, n))


#: ``torch.nn`` layer types stepped as pure functions of one time step's input.
STATELESS_TYPES: tuple[type, ...] = (
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
    *_types(
        "FractionalMaxPool2d", "FractionalMaxPool3d", "MaxUnpool1d", "MaxUnpool2d", "MaxUnpool3d"
    ),
    nn.modules.padding._ConstantPadNd,
    nn.modules.padding._ReflectionPadNd,
    nn.modules.padding._ReplicationPadNd,
    *_types(
        "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d"
    ),
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *_types("RMSNorm"),
    nn.Upsample,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    *_types("ChannelShuffle"),
    nn.Embedding,
    nn.CosineSimilarity,
    nn.PairwiseDistance,
    *_types(
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
    ),
)

_RUNNING_STATS_TYPES: tuple[type, ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)


def probe(fn: Any, *args: Any) -> Any:
    """Call ``fn(*args)`` without autograd and without consuming random numbers (shape probe)."""
    x = next((a for a in args if isinstance(a, Tensor)), None)
    devices = [x.device.index or 0] if x is not None and x.is_cuda else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        return fn(*args)


class StatelessAdapter(LayerAdapter):
    """A layer without state: ``y_t = module(x_t)``."""

    stateful = False

    def init_state(self, x_t: Tensor) -> State:
        return ()

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        return (), self.module(x_t)

    def check(self) -> None:
        m = self.module
        if (
            isinstance(m, _RUNNING_STATS_TYPES)
            and m.training
            and getattr(m, "track_running_stats", False)
        ):
            raise unsupported(
                m,
                self.path,
                "in training mode it updates its running statistics, and recomputation would "
                "update them again; use track_running_stats=False (per-step batch statistics, "
                "as in a time loop), call .eval(), or use LayerNorm/GroupNorm",
            )


class TimeLiftedAdapter(LayerAdapter):
    """A stateless layer written for whole sequences ``(T, B, ...)`` (inside a Norse
    ``SequentialState`` with sequence modules): ``y_t = module(x_t[None])[0]``."""

    stateful = False

    def __init__(self, inner: LayerAdapter) -> None:
        super().__init__(inner.module, inner.path)
        self.inner = inner

    def init_state(self, x_t: Tensor) -> State:
        return ()

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        _, y = self.inner.step((), x_t.unsqueeze(0))
        return (), y[0]

    def check(self) -> None:
        self.inner.check()


class RNNCellAdapter(LayerAdapter):
    """``nn.RNNCell`` / ``nn.GRUCell``: state ``h (B, H)``; ``nn.LSTMCell``: ``(h, c)``."""

    def init_state(self, x_t: Tensor) -> State:
        m = self.module
        h = torch.zeros(x_t.shape[0], m.hidden_size, dtype=x_t.dtype, device=x_t.device)
        return (h, h.clone()) if isinstance(m, nn.LSTMCell) else h

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        if isinstance(self.module, nn.LSTMCell):
            h, c = self.module(x_t, tuple(state))
            return (h, c), h
        h = self.module(x_t, state)
        return h, h

    def membrane(self, state: State) -> Tensor | None:
        return state[0] if isinstance(state, tuple) else state


_STATE_NAMES = {"state", "states", "hidden", "hx", "h", "carry", "s", "h0", "state_in"}


def _state_argument(module: nn.Module) -> bool:
    """Whether ``module.forward``'s second argument looks like a state."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return False
    params = [
        p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(params) >= 2 and (params[1].name in _STATE_NAMES or "state" in params[1].name)


def _zeros_like_tree(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: torch.zeros_like(t) if isinstance(t, Tensor) else t, tree
    )


class StatefulAdapter(LayerAdapter):
    """Any module with ``forward(x, state) -> (y, state)``."""

    def init_state(self, x_t: Tensor) -> State:
        m = self.module
        for name in ("initial_state", "init_state"):
            fn = getattr(m, name, None)
            if callable(fn):
                return fn(x_t)
        try:
            _, s = probe(m, x_t, None)
        except Exception as err:  # the module does not accept state=None
            raise unsupported(
                m,
                self.path,
                f"it has no initial_state(x) method and module(x, None) failed ({err!r}); "
                "give it one, or pass state=... to the wrapped forward",
            ) from err
        return _zeros_like_tree(s)

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        y, s = self.module(x_t, state)
        return s, y


def _is_stateless(m: nn.Module) -> bool:
    return isinstance(m, STATELESS_TYPES + _RUNNING_STATS_TYPES)


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
    return _state_argument(m) and not isinstance(m, nn.RNNBase)


REGISTRATIONS: list[Registration] = [
    Registration(
        _is_stateless,
        StatelessAdapter,
        "stateless torch.nn layers",
        "Linear, Conv*, Flatten, Unflatten, Dropout*, pooling, padding, Identity, "
        "activations, LayerNorm, GroupNorm, Upsample, Embedding; BatchNorm/InstanceNorm "
        "only in eval() mode or with track_running_stats=False",
    ),
    Registration(
        _is_rnn_cell, RNNCellAdapter, "torch.nn RNN cells", "nn.RNNCell, nn.GRUCell, nn.LSTMCell"
    ),
    Registration(_is_rnn, _rnn_error, "torch.nn sequence RNNs"),
    Registration(
        _is_generic,
        StatefulAdapter,
        "generic",
        "any module with forward(x, state) -> (y, state) (initial state from its "
        "initial_state(x)/init_state(x) method, else zeros)",
    ),
]
