"""The adapter protocol and the adapter registry.

An *adapter* turns one layer (an ``nn.Module``) into the two things :func:`spikeckpt.scan` needs:

- ``init_state(x_t) -> state``: the layer's state before the first step, given an example input
  of one time step ``x_t`` (shape ``(B, ...)``, the layer's own input); a tensor, a tuple, a
  NamedTuple or a nested mix. Stateless layers return ``()``.
- ``step(state, x_t) -> (state, y_t)``: one time step as a pure function: same inputs, same
  outputs, no state left inside the module (``y_t`` has shape ``(B, ...)``).

Adapters are found by :func:`adapter_for`, which asks the registry in order: adapters added with
:func:`register_adapter` (newest first), then the built-in ones (snnTorch, Norse, stateless
``torch.nn`` layers, ``torch.nn`` RNN cells, the generic ``forward(x, state) -> (y, state)``
adapter). A module no adapter accepts raises :class:`~spikeckpt.errors.UnsupportedLayerError`
naming its path in the model and listing what is supported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from spikeckpt.errors import UnsupportedLayerError

__all__ = [
    "LayerAdapter",
    "Registration",
    "adapter_for",
    "register_adapter",
    "registered_adapters",
    "supported_summary",
    "unsupported",
    "unregister_adapter",
]

State = Any


class LayerAdapter:
    """Base class of every adapter: one layer stepped one time step at a time.

    Subclasses override :meth:`init_state` and :meth:`step`; the other methods have defaults.

    Attributes:
        module: the adapted layer (the user's module, not a copy).
        path: the layer's dotted path in the wrapped model (``""`` for the root), for messages.
    """

    #: whether the layer carries state over time steps
    stateful: bool = True

    def __init__(self, module: nn.Module, path: str = "") -> None:
        self.module = module
        self.path = path

    # -- the two functions scan needs ------------------------------------------------------
    def init_state(self, x_t: Tensor) -> State:
        """State before step 0 for an input of one step ``x_t`` ``(B, ...)``."""
        raise NotImplementedError

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        """One step: ``(state_t, x_t (B, ...)) -> (state_{t+1}, y_t (B, ...))``. Pure."""
        raise NotImplementedError

    # -- optional hooks --------------------------------------------------------------------
    def membrane(self, state: State) -> Tensor | None:
        """The membrane potential ``(B, ...)`` in ``state`` (for ``output="mem"``), or None."""
        return None

    def extra_params(self) -> list[Tensor]:
        """Tensors requiring grad that the step uses but ``module.parameters()`` does not list."""
        return []

    def check(self) -> None:
        """Raise :class:`UnsupportedLayerError` if the layer cannot be stepped exactly *now*.

        Called at every forward (a layer's mode may change after wrapping, e.g. ``.train()``).
        """

    def cleanup(self) -> None:
        """Drop any state or graph the framework left on the module (called after forward)."""

    def coerce_state(self, state: State, x_t: Tensor) -> State:
        """Turn a user-given state into this adapter's state structure (default: unchanged)."""
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.module).__name__} at {self.path or '<root>'!r})"


Predicate = Callable[[nn.Module], bool]
Factory = Callable[[nn.Module, str], LayerAdapter]


@dataclass(frozen=True)
class Registration:
    """One registry entry: ``factory(module, path)`` is used when ``predicate(module)`` holds."""

    predicate: Predicate
    factory: Factory
    name: str
    description: str = ""


_USER: list[Registration] = []
_BUILTIN: list[Registration] | None = None


def register_adapter(
    predicate: Predicate, factory: Factory, *, name: str | None = None, description: str = ""
) -> Registration:
    """Add an adapter: layers for which ``predicate(module)`` is true use ``factory(module, path)``.

    User registrations are tried before the built-in ones, newest first, so they can also
    override a built-in adapter. Returns the entry (pass it to :func:`unregister_adapter`).

    Example::

        register_adapter(lambda m: isinstance(m, MyCell), lambda m, path: MyCellAdapter(m, path))
    """
    entry = Registration(
        predicate, factory, name or getattr(factory, "__name__", "adapter"), description
    )
    _USER.insert(0, entry)
    return entry


def unregister_adapter(entry: Registration) -> None:
    """Remove an entry added by :func:`register_adapter`."""
    _USER.remove(entry)


def _builtin() -> list[Registration]:
    global _BUILTIN
    if _BUILTIN is None:
        from spikeckpt.adapters import generic, sequential

        _BUILTIN = [
            Registration(
                _is_snntorch,
                _snntorch_factory,
                "snntorch",
                "snnTorch Leaky, Synaptic, Alpha, Lapicque, RLeaky, RSynaptic, SLSTM "
                "(input_size == hidden_size), SConv2dLSTM, DeltaLeaky; init_hidden "
                "True or False",
            ),
            Registration(
                _is_norse,
                _norse_factory,
                "norse",
                "Norse cells (LIFCell, LIFRecurrentCell, LIFBoxCell, LIFAdExCell, "
                "LIFExCell, LIFRefracCell, LICell, ... any SNNCell/SNNRecurrentCell), "
                "sequence modules (LIF, LIFRecurrent, LI, ... any SNN/SNNRecurrent), "
                "SequentialState, Lift(any supported layer)",
            ),
            *sequential.REGISTRATIONS,
            *generic.REGISTRATIONS,
        ]
    return _BUILTIN


def registered_adapters() -> list[Registration]:
    """Every registry entry in lookup order (user entries first)."""
    return [*_USER, *_builtin()]


def supported_summary() -> str:
    """A human-readable list of what can be wrapped (used in error messages)."""
    lines = [f"  - {r.name}: {r.description}" for r in registered_adapters() if r.description]
    return "\n".join(lines)


def unsupported(module: nn.Module, path: str, reason: str) -> UnsupportedLayerError:
    """Build the error for a layer that cannot be stepped: its path, type, reason, the list."""
    where = repr(path) if path else "<root>"
    kind = f"{type(module).__module__}.{type(module).__qualname__}"
    return UnsupportedLayerError(
        f"layer {where} ({kind}) cannot be wrapped: {reason}\n"
        f"Supported layers:\n{supported_summary()}\n"
        "Add your own with spikeckpt.adapters.register_adapter(predicate, factory)."
    )


def adapter_for(module: nn.Module, path: str = "") -> LayerAdapter:
    """The adapter for ``module`` (at dotted ``path`` in the model), or raise
    :class:`UnsupportedLayerError`."""
    for entry in registered_adapters():
        if entry.predicate(module):
            return entry.factory(module, path)
    raise unsupported(module, path, "no adapter knows this layer type")


def _from_package(module: nn.Module, package: str) -> bool:
    """Whether the layer's class (or a base class, for user subclasses) comes from ``package``.

    Checks module names only, so the framework is imported only when one of its layers is found.
    """
    return any((c.__module__ or "").split(".")[0] == package for c in type(module).__mro__)


def _is_snntorch(module: nn.Module) -> bool:
    return _from_package(module, "snntorch")


def _is_norse(module: nn.Module) -> bool:
    return _from_package(module, "norse")


def _snntorch_factory(module: nn.Module, path: str) -> LayerAdapter:
    from spikeckpt.adapters import snntorch as _snn

    return _snn.make_adapter(module, path)


def _norse_factory(module: nn.Module, path: str) -> LayerAdapter:
    from spikeckpt.adapters import norse as _norse

    return _norse.make_adapter(module, path)
