"""A wrapped model's state: its ``state_dict`` under the original model's keys, and what it
made from the model's modules, made again when the model changes.

`CheckpointedSequence` holds the model as its ``module``; its state dict hooks drop that
prefix when saving and accept the original model's keys (and prefixed ones) when loading, so
checkpoints move freely between the plain and the wrapped model. What it made from the model
(the adapter, layer-wise blocks and their verified kernels, a compiled step, its own planner's
decisions) is made again when the model changes after a call, and left out of copies
(`Remade`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from spikeckpt.adapters.protocol import LayerAdapter
from spikeckpt.adapters.registry import adapter_for, model_key
from spikeckpt.adapters.sequential import StackAdapter
from spikeckpt.errors import ConfigError
from spikeckpt.wrapped.call_tensors import param_ids

__all__ = [
    "INNER",
    "Remade",
    "add_prefix",
    "has_membrane",
    "no_membrane",
    "strip_missing",
    "strip_prefix",
]

#: the attribute of `CheckpointedSequence` that holds the wrapped model
INNER = "module"


def strip_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """state_dict hook: ``prefix + "module." + key`` -> ``prefix + key`` (and metadata)."""
    inner = prefix + INNER + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        own = prefix + INNER
        for key in [k for k in meta if k == own or k.startswith(own + ".")]:
            new = prefix[:-1] if key == own else prefix + key[len(own) + 1 :]
            meta[new] = meta.pop(key)


def add_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    """load_state_dict pre-hook: accept the original model's keys (and already prefixed ones)."""
    inner = prefix + INNER + "."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def strip_missing(module: nn.Module, incompatible: Any) -> None:
    """Report missing/unexpected keys under the original model's names."""
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [k.replace(INNER + ".", "", 1) if k.startswith(INNER + ".") else k for k in keys]


#: what is made from the model's modules (left out of copies, remade from the copy's)
_MADE = ("adapter", "_blocks", "_layer_blocks", "_compiled_step", "_own", "_param_ids")


class Remade(nn.Module):
    """A module holding an adapter made from ``self.module`` (`model_key` says when it is
    stale) and what was made from the adapter."""

    module: nn.Module
    adapter: LayerAdapter
    output: str
    as_call: bool
    #: ``wrap(..., output=None)``: ``output`` and ``as_call`` follow what the model's own
    #: call returns, read again when the model changes (a last neuron set to ``output=True``)
    follows_call: bool = False
    _key: tuple[Any, ...]
    #: the identities of the model's parameters when the adapter was made (`params_swapped`)
    _param_ids: frozenset[int]

    def _refresh(self) -> None:
        """Remake the adapter, and drop what was made from it, when the model's layers or
        their options changed since it was made: a layer replaced or appended (``net[1] =
        snn.Leaky(...)``), a neuron's ``spike_grad`` or ``reset_mechanism`` set, Norse's
        ``cell.p`` or ``dt`` reassigned, a copy. Tensors changed in
        place (an optimizer's step, ``beta.fill_``, ``.double()``) keep it: the steps read
        the module's tensors at each call."""
        key = model_key(self.module)
        if key == self._key:
            return
        adapter = adapter_for(self.module, "")
        adapter.cleanup()
        if self.follows_call:
            self.as_call = adapter.returns_more
            self.output = "both" if self.as_call else "spikes"
        if self.output != "spikes" and not self.as_call and not has_membrane(adapter):
            raise ConfigError(
                f"output={self.output!r} needs the last layer to be a neuron with a membrane "
                f"potential, and the model changed since wrapping: its last layer is now "
                f"{adapter!r}; wrap it again with output='spikes'"
            )
        self.__dict__.update(
            dict.fromkeys(_MADE), adapter=adapter, _key=key, _param_ids=param_ids(self.module)
        )

    def __getstate__(self) -> dict[str, Any]:
        """For `copy.deepcopy` and pickle: what is made from the model (closures over its
        modules among them) is left out and made again from the copy's own modules."""
        state = dict(super().__getstate__())
        state.update(dict.fromkeys(_MADE), _key=())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_blocks_exact", state.get("exact", False))  # older pickles
        if "_key" not in state:
            state.update(dict.fromkeys(_MADE))
        super().__setstate__(state)
        if self.adapter is None:
            self.__dict__.update(
                adapter=adapter_for(self.module, ""),
                _key=model_key(self.module),
                _param_ids=param_ids(self.module),
            )


def _last_layer(adapter: LayerAdapter) -> LayerAdapter:
    while isinstance(adapter, StackAdapter) and adapter.layers:
        adapter = adapter.layers[-1]
    return adapter


def has_membrane(adapter: LayerAdapter) -> bool:
    """Whether the last layer ``adapter`` steps is a neuron with a membrane potential."""
    return type(_last_layer(adapter)).membrane is not LayerAdapter.membrane


def no_membrane(output: str, adapter: LayerAdapter) -> ConfigError:
    """The refusal of ``output="mem"`` / ``"both"`` for a model whose last layer (``adapter``'s)
    has no membrane spikeckpt knows, naming that layer and the way forward."""
    last = _last_layer(adapter)
    where = f"{type(last.module).__name__} at {last.path or '<root>'!r}"
    way = (
        "a neuron of yours has no membrane spikeckpt knows: return what you need from its "
        "forward, e.g. forward(x, mem) -> ((spk, mem), mem), with output=None"
        if last.stateful
        else "end the model with a neuron (snnTorch, Norse), or use output=None"
    )
    return ConfigError(
        f"output={output!r} needs the last layer to be a neuron with a membrane potential "
        f"spikeckpt knows; the last layer is {where}: {way}"
    )
