"""The adapter registry: which adapter steps which layer.

`adapter_for` asks the registry in order: adapters added with `register_adapter`
(newest first), then the built-in ones (snnTorch, Norse, stacks, stateless ``torch.nn`` layers,
``torch.nn`` RNN cells, neurons of yours by the arity of ``forward``, stateless layers of
yours). A module no adapter accepts raises [`UnsupportedLayerError`][spikeckpt.errors.UnsupportedLayerError]
naming its path in the model and listing what is supported.

This is the only adapter module that imports the built-in adapter modules (snnTorch's and
Norse's lazily, when one of their layers is found); those that adapt children receive
`adapter_for` as an argument.
"""

from __future__ import annotations

import sys
from typing import Any, cast

from torch import Tensor, nn

from spikeckpt.adapters import generic, sequential
from spikeckpt.adapters.protocol import (
    Factory,
    LayerAdapter,
    Predicate,
    Registration,
    unsupported,
)
from spikeckpt.errors import UnsupportedLayerError

__all__ = [
    "Registration",
    "adapter_for",
    "model_key",
    "norse_sequence_dropouts",
    "register_adapter",
    "registered_adapters",
    "supported_summary",
    "unregister_adapter",
]

_USER: list[Registration] = []
_BUILTIN: list[Registration] | None = None
_LIST_HEADER = "Supported layers:\n"


def register_adapter(
    predicate: Predicate, factory: Factory, *, name: str | None = None, description: str = ""
) -> Registration:
    """Add an adapter: layers for which ``predicate(module)`` is true use ``factory(module, path)``.

    User registrations are tried before the built-in ones, newest first, so they can also
    override a built-in adapter. Returns the entry (pass it to `unregister_adapter`).

    Example::

        register_adapter(lambda m: isinstance(m, MyCell), lambda m, path: MyCellAdapter(m, path))
    """
    entry = Registration(
        predicate, factory, name or cast(str, getattr(factory, "__name__", "adapter")), description
    )
    _USER.insert(0, entry)
    return entry


def unregister_adapter(entry: Registration) -> None:
    """Remove an entry added by `register_adapter`."""
    _USER.remove(entry)


def _builtin() -> list[Registration]:
    global _BUILTIN
    if _BUILTIN is None:
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
            *sequential.registrations(adapter_for),
            *generic.registrations(adapter_for),
        ]
    return _BUILTIN


def registered_adapters() -> list[Registration]:
    """Every registry entry in lookup order (user entries first)."""
    return [*_USER, *_builtin()]


def supported_summary() -> str:
    """A human-readable list of what can be wrapped (used in error messages)."""
    lines = [f"  - {r.name}: {r.description}" for r in registered_adapters() if r.description]
    return "\n".join(lines)


def _refuse_data_parallel(module: nn.Module, path: str) -> None:
    """Refuse a ``DistributedDataParallel`` / ``DataParallel`` around the model, naming the
    order that works: wrap the model, then hand the wrapped model to DDP."""
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        kind = type(module).__name__
        raise unsupported(
            module,
            path,
            f"it is the {kind} wrapper around your model, whose forward is the whole model "
            f"(and whose gradient hooks spikeckpt would bypass). Wrap the model first and "
            f"give the wrapped model to {kind}: {kind}(spikeckpt.wrap(model, ...)) (see "
            "docs/ddp.md)",
        )


def adapter_for(module: nn.Module, path: str = "") -> LayerAdapter:
    """The adapter for ``module`` (at dotted ``path`` in the model), or raise
    [`UnsupportedLayerError`][spikeckpt.errors.UnsupportedLayerError] (its message ends with the list of supported layers)."""
    _load_framework_adapters(module)
    try:
        for entry in registered_adapters():
            if entry.predicate(module):
                return entry.factory(module, path)
        if hasattr(module, "_orig_mod") and type(module).__name__ == "OptimizedModule":
            raise unsupported(
                module,
                path,
                "it is the wrapper torch.compile(model) returns, whose forward is the compiled "
                "whole model. Wrap the model itself: spikeckpt.wrap(model, compile=True) "
                "compiles its step (or the fused neurons, layer-wise); torch.compile(seq) "
                "after wrapping runs spikeckpt's call as without it (the code around it "
                "compiled)",
            )
        _refuse_data_parallel(module, path)
        raise unsupported(module, path, "no adapter knows this layer type")
    except UnsupportedLayerError as err:
        message = str(err)
        if _LIST_HEADER not in message:
            err.args = (
                f"{message}\n{_LIST_HEADER}{supported_summary()}\n"
                "Add your own with spikeckpt.adapters.register_adapter(predicate, factory).",
            )
        raise


#: attributes every ``nn.Module`` has (its parameter, buffer, child and hook dicts, mode)
_MODULE_ATTRS = frozenset(vars(nn.Module()))
_PLAIN = (str, int, float, bool, type(None))


def model_key(model: nn.Module) -> tuple[Any, ...]:
    """What the adapters of ``model`` are made from, comparable with ``==``: each module at
    each position (identity and type) and its non-tensor attributes (plain values by value,
    objects such as a snnTorch ``spike_grad``, a bound ``state_function`` or Norse's ``p`` by
    identity), the names of its parameters and of its leaf buffers that require grad (a
    learnable ``beta``; not a hidden state that the model's own loop left holding its graph,
    snnTorch's ``init_hidden`` ``mem``: that is no change, and counting it remade the adapter
    and planned again at each wrapped call after a plain one). Equal keys: the adapter made
    for ``model`` before still steps it. Tensor objects are not part of it:
    the adapters read them at each call (changed in place by an optimizer's step or
    ``.double()``), and a parameter swapped in for one call (``torch.func.functional_call``)
    is the wrapper's to refuse, not to adapt to."""
    key: list[Any] = []
    for name, m in model.named_modules(remove_duplicate=False):
        attrs = tuple(
            (k, v if isinstance(v, _PLAIN) else id(v))
            for k, v in vars(m).items()
            if k not in _MODULE_ATTRS
            and not k.startswith("_spikeckpt")  # the engine's own marks
            and not isinstance(v, Tensor)
        )
        # names only: which tensors are parameters or buffers requiring grad (``lif.beta =
        # nn.Parameter(...)``, ``lif.beta.requires_grad_()``), not which tensor objects
        params = tuple(m._parameters)
        grads = tuple(
            k for k, t in m._buffers.items() if t is not None and t.requires_grad and t.is_leaf
        )
        key.append((name, id(m), type(m), attrs, params, grads))
    return tuple(key)


def _from_package(module: nn.Module, package: str) -> bool:
    """Whether the layer's class (or a base class, for user subclasses) comes from ``package``.

    Checks module names only, so the framework is imported only when one of its layers is found.
    """
    return any((c.__module__ or "").split(".")[0] == package for c in type(module).__mro__)


def _is_snntorch(module: nn.Module) -> bool:
    return _from_package(module, "snntorch") and not isinstance(module, nn.Sequential)


def _is_norse(module: nn.Module) -> bool:
    return _from_package(module, "norse")


def _load_framework_adapters(module: nn.Module) -> None:
    """Import the snnTorch adapters where ``module`` holds an snnTorch neuron, inside a
    module of yours too: they tell the generic checks which attributes snnTorch writes on
    its neurons at every call (``generic.WRITTEN_BY_CLASS``)."""
    loaded = "spikeckpt.adapters.snntorch" in sys.modules  # adapter_for recurses: once
    if not loaded and any(_is_snntorch(m) for m in module.modules()):
        from spikeckpt.adapters import snntorch as _snn  # noqa: F401


def norse_sequence_dropouts(module: nn.Module) -> str | None:
    """The Norse adapters' `sequence_dropouts` warning for ``module``, or None; Norse is
    imported only where ``module`` holds one of its layers."""
    if not any(_is_norse(m) for m in module.modules()):
        return None
    from spikeckpt.adapters import norse as _norse

    return _norse.sequence_dropouts(module)


def _snntorch_factory(module: nn.Module, path: str) -> LayerAdapter:
    from spikeckpt.adapters import snntorch as _snn

    return _snn.make_adapter(module, path, adapter_for)


def _norse_factory(module: nn.Module, path: str) -> LayerAdapter:
    from spikeckpt.adapters import norse as _norse

    options = _norse.stack_options(module, path)
    if options is not None:  # SequentialState
        return sequential.StackAdapter.from_sequential(module, path, adapter_for, **options)
    return _norse.make_adapter(module, path, adapter_for)
