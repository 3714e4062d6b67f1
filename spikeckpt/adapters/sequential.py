"""Stacks: ``nn.Sequential`` (and Norse's ``SequentialState``) as one step.

The stack's state is a tuple with one entry per layer (``()`` for stateless layers, nested tuples
for nested ``nn.Sequential``); its step runs the layers in order, ``y_t`` is the last layer's
output (spikes for a neuron layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from spikeckpt.adapters.base import LayerAdapter, Registration, State, adapter_for, unsupported
from spikeckpt.adapters.generic import StatelessAdapter, TimeLiftedAdapter, probe

__all__ = ["StackAdapter"]


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
