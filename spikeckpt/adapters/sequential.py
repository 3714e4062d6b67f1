"""Stacks: ``nn.Sequential`` (and Norse's ``SequentialState``) as one step.

The stack's state is a tuple with one entry per layer (``()`` for stateless layers, nested tuples
for nested ``nn.Sequential``); its step runs the layers in order, ``y_t`` is the last layer's
output (spikes for a neuron layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from spikeckpt.adapters.base import LayerAdapter, Registration, State, adapter_for, unsupported
from spikeckpt.adapters.generic import StatelessAdapter, TimeLiftedAdapter, probe

__all__ = ["Block", "StackAdapter", "split_blocks"]


class StackAdapter(LayerAdapter):
    """Layers applied in order at each step; state ``(s_0, s_1, ...)``."""

    def __init__(self, module: nn.Module, path: str, layers: Sequence[LayerAdapter]) -> None:
        super().__init__(module, path)
        self.layers = list(layers)
        self.stateful = any(layer.stateful for layer in self.layers)

    @classmethod
    def from_sequential(
        cls, module: nn.Module, path: str = "", *, sequence_mode: bool = False
    ) -> StackAdapter:
        """Adapters for the children of ``module`` (in sequence mode, plain stateless layers
        are applied to ``x_t[None]``: they were written for ``(T, B, ...)`` tensors)."""
        layers = []
        for name, child in module.named_children():
            sub = f"{path}.{name}" if path else name
            adapter = adapter_for(child, sub)
            # (a Lift(m) child gives m's adapter: m already works on one step)
            if sequence_mode and type(adapter) is StatelessAdapter and adapter.module is child:
                adapter = TimeLiftedAdapter(adapter)
            layers.append(adapter)
        return cls(module, path, layers)

    def init_state(self, x_t: Tensor, given: Sequence[Any] | None = None) -> State:
        """Each layer's initial state (``given[i]`` where given and not None); runs one
        probe step (no autograd, random state restored) to learn every layer's input shape."""

        def run(x: Tensor) -> tuple[Any, ...]:
            states = []
            for i, layer in enumerate(self.layers):
                g = given[i] if given is not None else None
                s = layer.init_state(x) if g is None else layer.coerce_state(g, x)
                states.append(s)
                if i + 1 < len(self.layers):
                    _, x = layer.step(s, x)
            return tuple(states)

        try:
            return probe(run, x_t)
        finally:
            self.cleanup()

    def coerce_state(self, state: State, x_t: Tensor) -> State:
        if not isinstance(state, (tuple, list)) or len(state) != len(self.layers):
            raise ValueError(
                f"state for {self.path or 'the model'} must be a tuple or list of "
                f"{len(self.layers)} layer states (None for a fresh one)"
            )
        return self.init_state(x_t, given=list(state))

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        new = []
        for layer, s in zip(self.layers, state, strict=True):
            s, x_t = layer.step(s, x_t)
            new.append(s)
        return tuple(new), x_t

    def membrane(self, state: State) -> Tensor | None:
        return self.layers[-1].membrane(state[-1]) if self.layers else None

    def extra_params(self) -> list[Tensor]:
        return [t for layer in self.layers for t in layer.extra_params()]

    def check(self) -> None:
        for layer in self.layers:
            layer.check()

    def cleanup(self) -> None:
        for layer in self.layers:
            layer.cleanup()


# ---------------------------------------------------------------------- layer-wise blocks
# (used by the layer-wise granularity, spikeckpt.engine.layerwise)


@dataclass
class Block:
    """One block of a feed-forward stack: stateless synapse layers, then one stateful neuron.

    Attributes:
        synapses: adapters of the stateless layers (Linear, Conv, Flatten, Dropout, ...) that
            map the block's input to the neuron's input, in order.
        neuron: the adapter of the stateful layer (recurrence inside it is fine).
        index: position of the neuron in the stack's layers (its state is ``state[index]``),
            ``None`` when the model is a single neuron (its state is the whole state).
        synapse_indices: positions of the synapse layers in the stack's layers.
    """

    synapses: list[LayerAdapter]
    neuron: LayerAdapter
    index: int | None
    synapse_indices: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.neuron.path or "<root>"


def split_blocks(adapter: LayerAdapter) -> list[Block]:
    """Split a wrapped model into feed-forward blocks (stateless layers, then one stateful
    layer), or raise :class:`~spikeckpt.errors.UnsupportedLayerError` (also a ``TypeError``)
    saying why the model is not a feed-forward stack of such blocks.

    Accepted: a flat ``nn.Sequential`` / Norse ``SequentialState`` whose layers are stateless
    layers and neurons, ending with a neuron; or a single neuron. Not accepted: nested stacks,
    stacks ending with stateless layers, stacks with no neuron, layers whose recurrence spans
    more than one layer (not expressible in a Sequential anyway).
    """
    why = "layer-wise granularity needs a feed-forward stack of blocks (synapse layers such as "
    why += "Linear/Conv/Flatten/Dropout, then one neuron); "
    if not isinstance(adapter, StackAdapter):
        if not adapter.stateful:
            raise unsupported(adapter.module, adapter.path, why + "this layer has no state")
        return [Block([], adapter, None, [])]
    blocks: list[Block] = []
    pending: list[LayerAdapter] = []
    pending_idx: list[int] = []
    for i, layer in enumerate(adapter.layers):
        if isinstance(layer, StackAdapter):
            raise unsupported(
                layer.module,
                layer.path,
                why + "it is a nested stack; flatten it into one nn.Sequential",
            )
        if layer.stateful:
            blocks.append(Block(pending, layer, i, pending_idx))
            pending, pending_idx = [], []
        else:
            pending.append(layer)
            pending_idx.append(i)
    if not blocks:
        raise unsupported(adapter.module, adapter.path, why + "the stack has no stateful layer")
    if pending:
        names = ", ".join(repr(p.path) for p in pending)
        raise unsupported(
            adapter.module,
            adapter.path,
            why + f"the stack ends with stateless layers after its last neuron ({names}); "
            "end it with a neuron (apply the readout layers outside the wrapped model)",
        )
    return blocks


def _is_sequential(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential)


def _from_sequential(m: nn.Module, path: str) -> LayerAdapter:
    return StackAdapter.from_sequential(m, path)


def _container_error(m: nn.Module, path: str) -> LayerAdapter:
    raise unsupported(m, path, "a ModuleList/ModuleDict has no forward order; use nn.Sequential")


REGISTRATIONS: list[Registration] = [
    Registration(
        _is_sequential,
        _from_sequential,
        "stacks",
        "nn.Sequential of any supported layers (nested allowed)",
    ),
    Registration(
        lambda m: isinstance(m, (nn.ModuleList, nn.ModuleDict)), _container_error, "containers"
    ),
]
