"""The adapter protocol: what an adapter is, and the error for a layer that has none.

An *adapter* turns one layer (an ``nn.Module``) into the two things [`spikeckpt.scan`][spikeckpt.engine.scan.scan] needs:

- ``init_state(x_t) -> state``: the layer's state before the first step, given an example input
  of one time step ``x_t`` (shape ``(B, ...)``, the layer's own input); a tensor, a tuple, a
  NamedTuple or a nested mix. Stateless layers return ``()``.
- ``step(state, x_t) -> (state, y_t)``: one time step as a pure function: same inputs, same
  outputs, no state left inside the module (``y_t`` has shape ``(B, ...)``).

This module imports no other adapter module: the built-in adapters import it, and the registry
(`spikeckpt.adapters.registry`) imports them. Adapters that adapt children (stacks, Norse
``SequentialState`` / ``Lift``) receive the registry's lookup as an `AdapterFor` argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from spikeckpt.errors import UnsupportedLayerError

__all__ = [
    "AdapterFor",
    "Factory",
    "LayerAdapter",
    "Predicate",
    "Registration",
    "State",
    "attribute_tensors",
    "backward_hooked",
    "describe",
    "no_hooks",
    "plain_container",
    "unsupported",
]

State = Any


class LayerAdapter:
    """Base class of every adapter: one layer stepped one time step at a time.

    Subclasses override `init_state` and `step`; the other methods have defaults.

    Attributes:
        module: the adapted layer (the user's module, not a copy).
        path: the layer's dotted path in the wrapped model (``""`` for the root), for messages.
    """

    #: whether the layer carries state over time steps
    stateful: bool = True
    #: whether the layer's own call returns ``(output, state)`` (Norse's convention): the
    #: wrapped model then returns ``(outputs, final_state)`` too, so call sites stay the same
    returns_state: bool = False
    #: whether a plain ``nn.Sequential`` loop keeps the layer's state *on the module* between
    #: calls (snnTorch ``init_hidden=True``): a module at several positions then threads one
    #: state through all of them, in call order
    state_on_module: bool = False
    #: whether the layer's step draws random numbers from torch's generators where its code
    #: does not show it (a framework's random layer): the stack replays them; layer-wise,
    #: which replays Dropout's only, refuses the layer
    draws_random: bool = False

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

    @property
    def returns_more(self) -> bool:
        """Whether the layer's own per-step call returns more than ``y_t``
        (`call_outputs` is then not None)."""
        return False

    def call_outputs(self, state: State) -> tuple[Any, ...] | None:
        """What the layer's own per-step call returns after ``y_t``, from the state after the
        step, when it returns more than ``y_t`` (snnTorch ``output=True``: ``spk, mem =
        lif(x)`` gives ``(mem,)``); None when the call returns ``y_t`` alone."""
        return None

    def extra_params(self) -> list[Tensor]:
        """Tensors requiring grad that the step uses but ``module.parameters()`` does not list.

        Default: `attribute_tensors` of the module (a hand-written neuron's
        ``self.beta = torch.full(..., requires_grad=True)``)."""
        return attribute_tensors(self.module)

    def chunk_kernel(self) -> Any:
        """A `ChunkKernel` running this neuron over a whole
        time chunk (the layer-wise granularity fuses it), or None: stepped one call per step.
        The adapter offers one only for steps it knows to be elementwise and free of random
        draws; `spikeckpt.adapters.layered.layer_blocks` checks it against `step`
        once before using it."""
        return None

    def split_synapse(self) -> tuple[LayerAdapter, LayerAdapter] | None:
        """For a neuron holding its input's weights (Norse's ``LILinearCell``): the same step
        as ``(a stateless synapse adapter, the neuron after it)``, each computing what the
        layer's own call computes, so that the layer-wise granularity runs the synapse over a
        chunk and fuses the neuron. None (the default): the layer is its block's neuron."""
        return None

    def check(self) -> None:
        """Raise [`UnsupportedLayerError`][spikeckpt.errors.UnsupportedLayerError] if the layer cannot be stepped exactly *now*.

        Called at every forward (a layer's mode may change after wrapping, e.g. ``.train()``).
        """

    def cleanup(self) -> None:
        """Drop any state or graph the framework left on the module (called after forward)."""

    def coerce_state(self, state: State, x_t: Tensor) -> State:
        """Turn a user-given state into this adapter's state structure (default: unchanged)."""
        return state

    def user_state(self, state: State) -> State:
        """The final state as handed back to the user, in the framework's own format (default:
        unchanged); `coerce_state` takes it back."""
        return state

    def call_result(self, ys: Any, state: State) -> Any:
        """The whole call's output from the outputs over time ``ys`` and the final state, as
        the framework's own call returns it (default: ``ys``)."""
        return ys

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.module).__name__} at {self.path or '<root>'!r})"


def attribute_tensors(module: nn.Module) -> list[Tensor]:
    """Leaf tensors requiring grad that ``module`` or its submodules hold as plain attributes
    (not registered parameters), directly or in a tuple, list or dict attribute (NamedTuples
    too, nested once): ``self.beta = torch.full((n,), 0.9, requires_grad=True)``. Tensors a
    framework leaves on a module after a call carry a graph (not leaves) and are not listed."""
    found: dict[int, Tensor] = {}

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, Tensor):
            if value.requires_grad and value.is_leaf:
                found.setdefault(id(value), value)
        elif depth < 2 and isinstance(value, (tuple, list)):
            for item in value[:1000]:
                visit(item, depth + 1)
        elif depth < 2 and isinstance(value, dict):
            for item in list(value.values())[:1000]:
                visit(item, depth + 1)

    for m in module.modules():
        for value in vars(m).values():
            visit(value, 0)
    return list(found.values())


#: ``adapter_for(module, path) -> LayerAdapter``: the registry's lookup, passed to adapters of
#: containers so they can adapt their children without importing the registry.
AdapterFor = Callable[[nn.Module, str], LayerAdapter]
Predicate = Callable[[nn.Module], bool]
Factory = Callable[[nn.Module, str], LayerAdapter]


@dataclass(frozen=True)
class Registration:
    """One registry entry: ``factory(module, path)`` is used when ``predicate(module)`` holds."""

    predicate: Predicate
    factory: Factory
    name: str
    description: str = ""


def describe(module: nn.Module) -> str:
    """``package.Class`` of a module, for messages."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def unsupported(module: nn.Module, path: str, reason: str) -> UnsupportedLayerError:
    """Build the error for a layer that cannot be stepped: its path, type and the reason.

    `spikeckpt.adapters.registry.adapter_for` appends the list of supported layers.
    """
    where = repr(path) if path else "<root>"
    return UnsupportedLayerError(f"layer {where} ({describe(module)}) cannot be wrapped: {reason}")


def no_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs its ``forward`` and nothing else: no forward hook and
    no backward hook (`backward_hooked`) of its own or a global one."""
    from torch.nn.modules import module as torch_module

    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or getattr(torch_module, "_global_forward_hooks", None)
        or getattr(torch_module, "_global_forward_pre_hooks", None)
        or backward_hooked(module)
    )


def backward_hooked(module: nn.Module) -> bool:
    """Whether ``module`` has a backward hook (``register_full_backward_hook``,
    ``register_full_backward_pre_hook``, the old ``register_backward_hook``) of its own or a
    global one (``nn.modules.module.register_module_full_backward_hook``, ...). Such a hook
    sees each call's gradients as autograd hands them through the module's call, so a module
    with one is called step by step and taped, as the plain loop calls it: a chunk's batched
    call would hand it another shape (a hook normalising ``grad_output`` would scale
    otherwise), and a fused or untaped backward would skip it."""
    from torch.nn.modules import module as torch_module

    return bool(
        module._backward_hooks
        or module._backward_pre_hooks
        or getattr(torch_module, "_global_backward_hooks", None)
        or getattr(torch_module, "_global_backward_pre_hooks", None)
    )


def plain_container(module: nn.Module, forward: Callable[..., Any]) -> bool:
    """Whether calling the container ``module`` runs ``forward`` (its class's own, e.g.
    ``nn.Sequential.forward``) and no forward hook of its own, so that stepping its layers one
    by one, without calling it, runs what its call runs. A subclass or an instance with a
    ``forward`` of its own, or hooks on it, is a module of yours: stepped through its call."""
    return (
        type(module).forward is forward
        and "forward" not in vars(module)
        and not (module._forward_hooks or module._forward_pre_hooks)
    )
