"""Stacks: ``nn.Sequential`` (and Norse's ``SequentialState``) as one step.

The stack's state is a tuple with one entry per position (``()`` for stateless layers, nested
tuples for nested ``nn.Sequential``); its step runs the layers in order, ``y_t`` is the last
layer's output (spikes for a neuron layer).

Weight sharing: a module at several positions runs at each of them (the stack iterates its
positions, not ``named_children()``, which lists a repeated module once). A repeated
*stateful* module keeps one state per position when the framework passes states explicitly
(Norse cells, modules of yours with ``forward(x, state)``); when its state lives on the module
(snnTorch ``init_hidden=True``), the plain loop threads that one state through every position
in call order, and so does the stack: the state sits at the first position, later positions
hold ``()``.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from spikeckpt.adapters.generic import (
    CustomLayerAdapter,
    RNNCellAdapter,
    StatefulAdapter,
    StatelessAdapter,
    own_class,
    probe,
)
from spikeckpt.adapters.protocol import (
    AdapterFor,
    LayerAdapter,
    Registration,
    State,
    plain_container,
    unsupported,
)
from spikeckpt.adapters.time_lifted import TimeLiftedAdapter
from spikeckpt.engine.phase import RUNNING_STATS_TYPES
from spikeckpt.engine.tree import tree_leaves
from spikeckpt.errors import ConfigError

__all__ = ["Block", "StackAdapter", "check_given_state", "positions", "split_blocks"]

#: the adapters of stateless layers that a ``SequentialState`` of sequence modules hands whole
#: sequences: torch's layers and yours (`spikeckpt.adapters.time_lifted`)
_LIFTED = (StatelessAdapter, CustomLayerAdapter)


def _probe_step(layer: LayerAdapter, state: State, x: Any, given: Any) -> tuple[State, Any]:
    """``layer.step(state, x)``; a step failing on a state passed as ``state=`` whose batch
    differs from its input's (a previous batch's final state carried into a smaller last
    batch) is refused, naming the layer, where the framework (Norse, a module of yours) raised
    torch's shape error."""
    try:
        return layer.step(state, x)
    except RuntimeError as err:
        if given is None or not isinstance(x, Tensor) or x.dim() < 1:
            raise
        batch = x.shape[0]
        other = [
            tuple(t.shape)
            for t in tree_leaves(given)
            if isinstance(t, Tensor) and t.dim() == x.dim() and t.shape[0] not in (1, batch)
        ]
        if not other:
            raise
        raise ConfigError(
            f"state= for layer {layer.path or '<root>'} ({type(layer.module).__name__}): "
            f"it holds {', '.join(map(str, other))}, a batch of {other[0][0]}, this call's "
            f"input a batch of {batch} ({err}). Pass None for this layer (a fresh state) or "
            f"a state of batch {batch} (e.g. a previous batch's final state sliced to it)"
        ) from err


def check_given_state(adapter: LayerAdapter, state: State, x_0: Tensor) -> None:
    """A model wrapped alone (a Norse cell, a neuron of yours) given ``state=``: one probe
    step, so that a state of another batch than ``x_0`` is refused naming the layer (a stack
    steps a given state in its `init_state` already)."""
    if not isinstance(adapter, StackAdapter) and adapter.stateful:
        probe(_probe_step, adapter, state, x_0, state, module=adapter.module)


def positions(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, child)`` for every position of a container, repeats included (unlike
    ``named_children()``, which lists a module used twice once)."""
    return [(name, child) for name, child in module._modules.items() if child is not None]


def _state_leaves(adapter: LayerAdapter) -> Iterable[LayerAdapter]:
    """The stateful leaf adapters inside ``adapter`` (itself when it is not a stack)."""
    if isinstance(adapter, StackAdapter):
        for layer in adapter.owners():
            yield from _state_leaves(layer)
    elif adapter.stateful:
        yield adapter


class StackAdapter(LayerAdapter):
    """Layers applied in order at each step; state ``(s_0, s_1, ...)``, one per position.

    Attributes:
        layers: one adapter per position.
        slots: for each position, the position whose state entry it reads and writes (itself,
            or the first position of a repeated module whose state lives on the module).
        return_hidden: ``y_t`` is the list of every position's output, in order (Norse's
            ``SequentialState(..., return_hidden=True)``), not the last one's.
    """

    def __init__(
        self,
        module: nn.Module,
        path: str,
        layers: Sequence[LayerAdapter],
        *,
        explicit_states: bool = False,
        return_hidden: bool = False,
    ) -> None:
        super().__init__(module, path)
        self.return_hidden = return_hidden
        #: positions whose layer keeps a state that Norse's call does not thread (`from_sequential`)
        self.unthreaded: list[int] = []
        self.layers = list(layers)
        self.stateful = any(layer.stateful for layer in self.layers)
        self.state_on_module = any(layer.state_on_module for layer in self.layers)
        self.slots = self._share(explicit_states)
        self.returns_state = explicit_states
        for layer in self.layers[:-1]:
            # a neuron whose call returns a tuple: its step hands on the spikes alone (a nested
            # stack ending in one hands on its spikes: a stack of yours composed of stacks
            # whose loops unpack `spk, mem = stack(x_t)`, as snnTorch's autoencoder tutorial)
            if layer.returns_more and not isinstance(layer, StackAdapter):
                raise unsupported(
                    layer.module,
                    layer.path,
                    "its call returns a tuple (init_hidden=True with output=True: spk, mem, "
                    "...), and it is not the stack's last layer: your own loop's net(x_t) hands "
                    "the whole tuple to the next layer (a Linear raises on it), where spikeckpt "
                    "would hand on the spikes. Set output=False on every neuron but the last "
                    "(the wrapped model returns the last one's tuple; wrap(..., output='mem' or "
                    "'both') gives membranes)",
                )

    def _share(self, explicit_states: bool) -> list[int]:
        """Each position's state slot; raise when a stateful module is repeated in a way no
        single state layout reproduces."""
        first: dict[int, int] = {}
        slots = []
        for i, layer in enumerate(self.layers):
            j = first.setdefault(id(layer.module), i)
            share = j != i and layer.stateful and layer.state_on_module and not explicit_states
            if share and any(not leaf.state_on_module for leaf in _state_leaves(layer)):
                raise unsupported(
                    layer.module,
                    layer.path,
                    f"it is used at positions {self.layers[j].path!r} and {layer.path!r} and "
                    "holds layers that keep their state on the module (shared by both "
                    "positions) beside layers that take it explicitly (one per position); use "
                    "two instances",
                )
            slots.append(j if share else i)
        seen: dict[int, str] = {}
        for i in sorted(set(slots)):
            for leaf in _state_leaves(self.layers[i]):
                if not leaf.state_on_module:
                    continue
                other = seen.setdefault(id(leaf.module), leaf.path)
                if other != leaf.path:
                    raise unsupported(
                        leaf.module,
                        leaf.path,
                        f"this neuron is also used at {other!r}, at another nesting level; it "
                        "keeps one state on the module, which spikeckpt threads through "
                        "repeated positions of one nn.Sequential only; use two instances (share "
                        "weights by passing the same parameters), or repeat it in one "
                        "nn.Sequential",
                    )
        return slots

    def owners(self) -> list[LayerAdapter]:
        """The layers that own a state entry (repeats sharing one state are left out)."""
        return [layer for i, layer in enumerate(self.layers) if self.slots[i] == i]

    @classmethod
    def from_sequential(
        cls,
        module: nn.Module,
        path: str,
        adapter_for: AdapterFor,
        *,
        sequence_mode: bool = False,
        stateful_flags: Sequence[bool] | None = None,
        return_hidden: bool = False,
        lifted: Sequence[bool] | None = None,
    ) -> StackAdapter:
        """Adapters for every position of ``module`` (``adapter_for``: the registry's lookup).

        In sequence mode (a Norse ``SequentialState`` of sequence modules), plain stateless
        layers are applied to ``x_t[None]``: they were written for ``(T, B, ...)`` tensors.
        ``stateful_flags`` (Norse's ``SequentialState.stateful_layers``): a module of yours,
        or torch's ``nn.RNNCell`` / ``GRUCell`` / ``LSTMCell`` (whose ``forward`` has no
        ``state`` argument), that Norse calls without a state is stepped as a stateless layer,
        as Norse calls it: from a zero state at each step (before 2026-11-29 the cells' states
        were carried, 0.25-0.42 off Norse's loop, silently).
        Norse passes one state per position (``explicit_states``). ``return_hidden``: the
        step's output is every position's output (Norse's ``return_hidden=True``).
        """
        layers = []
        for i, (name, child) in enumerate(positions(module)):
            sub = f"{path}.{name}" if path else name
            adapter = adapter_for(child, sub)
            if (
                stateful_flags is not None
                and not stateful_flags[i]
                and isinstance(adapter, (StatefulAdapter, RNNCellAdapter))
            ):
                adapter = StatelessAdapter(child, sub)
            # (a Lift(m) child gives m's adapter: m already works on one step)
            if sequence_mode and type(adapter) in _LIFTED and adapter.module is child:
                adapter = TimeLiftedAdapter(cast(StatelessAdapter, adapter))
            layers.append(adapter)
        stack = cls(
            module,
            path,
            layers,
            explicit_states=stateful_flags is not None,
            return_hidden=return_hidden,
        )
        if lifted is not None:
            # ``lifted``: Norse's ``Lift`` positions. A Lift of a layer keeping state
            # (``Lift(LICell())``) starts it afresh at each call, returns ``(outputs, final
            # state)`` and leaves None in the state list
            stack.unthreaded = [i for i, layer in enumerate(layers) if layer.stateful and lifted[i]]
            for i in stack.unthreaded:
                if i + 1 in stack.unthreaded:
                    raise unsupported(
                        layers[i + 1].module,
                        layers[i + 1].path,
                        f"it follows {layers[i].path!r}, whose Lift hands it (outputs, final "
                        "state), and Norse's Lift starts this layer from that final state, "
                        "which a run stepped over time does not have at t=0; put a stateless "
                        "layer between them, or use the cells unlifted in a SequentialState "
                        "of cells",
                    )
        return stack

    def init_state(self, x_t: Tensor, given: Sequence[Any] | None = None) -> State:
        """Each position's initial state (``given[i]`` where given and not None); runs one
        probe step (no autograd, random state restored, no running statistics updated) to
        learn every layer's input shape. The layers' own initial states are made with
        autograd on, as the plain loop makes them: a learnable initial state (an
        ``initial_state(x)`` returning ``self.mem0.expand(...)``) gets its gradient."""

        def run(x: Tensor) -> tuple[Any, ...]:
            states: list[Any] = []  # each position's state at t=0
            live: dict[int, Any] = {}  # each slot's state as the probe step advances it
            for i, layer in enumerate(self.layers):
                j = self.slots[i]
                if j == i:
                    g = given[i] if given is not None else None
                    with torch.enable_grad():
                        s = layer.init_state(x) if g is None else layer.coerce_state(g, x)
                    states.append(s)
                    live[i] = s
                else:
                    states.append(())
                g = given[j] if given is not None else None
                if i + 1 < len(self.layers) or g is not None:
                    # a given state is stepped once here, the last layer's too: one of
                    # another batch fails in the framework's call, and is named here
                    live[j], x = _probe_step(layer, live[j], x, g)
            return tuple(states)

        try:
            return probe(run, x_t, module=self.module)
        finally:
            self.cleanup()

    def coerce_state(self, state: State, x_t: Tensor) -> State:
        if not isinstance(state, (tuple, list)) or len(state) != len(self.layers):
            raise ConfigError(
                f"state for {self.path or 'the model'} must be a tuple or list of "
                f"{len(self.layers)} layer states (None for a fresh one)"
            )
        given = [
            s if self.slots[i] == i and i not in self.unthreaded else None
            for i, s in enumerate(state)
        ]
        return self.init_state(x_t, given=given)

    def user_state(self, state: State) -> State:
        """Norse's ``SequentialState`` (``returns_state``): its own call's state list, ``None``
        at the positions it calls without a state, so that the final state goes back into
        Norse's loop (``model(x_t, state)`` assigns into the list; nested ones too); else the tuple
        as it is."""
        if not self.returns_state:
            return state
        return [
            layer.user_state(s) if layer.stateful and i not in self.unthreaded else None
            for i, (layer, s) in enumerate(zip(self.layers, state, strict=True))
        ]

    def call_result(self, ys: Any, state: State) -> Any:
        """A last ``Lift(cell)`` (not threaded): Norse's call returns ``(outputs, the cell's
        final state)`` as its output."""
        last = len(self.layers) - 1
        if self.return_hidden or last not in self.unthreaded:
            return ys
        return ys, self.layers[last].user_state(state[self.slots[last]])

    def step(self, state: State, x_t: Tensor) -> tuple[State, Any]:
        new = list(state)
        hidden: list[Any] = []
        for i, layer in enumerate(self.layers):
            j = self.slots[i]
            new[j], x_t = layer.step(new[j], x_t)
            if self.return_hidden:
                hidden.append(x_t)
        return tuple(new), (hidden if self.return_hidden else x_t)

    @property
    def returns_more(self) -> bool:
        return bool(self.layers) and not self.return_hidden and self.layers[-1].returns_more

    def call_outputs(self, state: State) -> tuple[Any, ...] | None:
        if not self.returns_more:
            return None
        return self.layers[-1].call_outputs(state[self.slots[-1]])

    def membrane(self, state: State) -> Tensor | None:
        if not self.layers:
            return None
        return self.layers[-1].membrane(state[self.slots[-1]])

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
    """

    synapses: list[LayerAdapter]
    neuron: LayerAdapter
    index: int | None

    @property
    def name(self) -> str:
        return self.neuron.path or "<root>"


def _split(neuron: LayerAdapter) -> tuple[list[LayerAdapter], LayerAdapter]:
    """``(synapses, neuron)`` of a neuron layer: its `split_synapse` where it offers one."""
    parts = neuron.split_synapse()
    return ([], neuron) if parts is None else ([parts[0]], parts[1])


def _refuse_in_place_on_a_state(
    neuron: LayerAdapter, synapses: Sequence[LayerAdapter], why: str
) -> None:
    """Refuse a layer built with ``inplace=True`` (``nn.ReLU``, ``nn.Dropout``) right after a
    neuron that returns its state as its output (``nn.GRUCell``'s ``h``, a module of yours
    returning ``(h, h)``): your loop's in-place op changes that neuron's state too, where a
    layer-wise run hands the layer a copy (before 2026-11-29 spikes differed from the loop's,
    silently). ``granularity="auto"`` then runs the stack, which runs it as the loop does."""
    if not isinstance(neuron, (RNNCellAdapter, StatefulAdapter)):
        return  # snnTorch's and Norse's spiking neurons return fresh spikes
    for layer in synapses:
        if any(getattr(m, "inplace", False) is True for m in layer.module.modules()):
            raise unsupported(
                layer.module,
                layer.path,
                why + f"it changes its input in place (inplace=True), and that input is "
                f"the state of {neuron.path!r} ({type(neuron.module).__name__} returns its "
                "state as its output), so your loop changes that state too, which a "
                "layer-wise run would not; build it with inplace=False, or use "
                "granularity='stack', which runs it as your loop does",
            )


def split_blocks(adapter: LayerAdapter) -> list[Block]:
    """Split a wrapped model into feed-forward blocks (stateless layers, then one stateful
    layer), or raise [`UnsupportedLayerError`][spikeckpt.errors.UnsupportedLayerError] (also a ``TypeError``)
    saying why the model is not a feed-forward stack of such blocks.

    Accepted: a flat ``nn.Sequential`` / Norse ``SequentialState`` whose layers are stateless
    layers and neurons, ending with a neuron; or a single neuron. A stateless module at several
    positions (weight sharing) is fine; BatchNorm is fine (it is applied step by step, never
    over a time chunk at once), once (tracking running statistics at two positions, it is
    refused: their order would differ). Not accepted: nested stacks, stacks ending with stateless
    layers, stacks with no neuron, a neuron repeated with one state threaded through its
    positions, a neuron whose state at t=0 is built by the module itself (``None``), synapse
    layers that may draw random numbers other than ``Dropout`` (layer-wise replays only those),
    and neuron modules that may draw them (a one-step block of yours with a Dropout inside).
    """
    why = "layer-wise granularity needs a feed-forward stack of blocks (synapse layers such as "
    why += "Linear/Conv/Flatten/Dropout, then one neuron); "
    if isinstance(adapter, StackAdapter) and adapter.return_hidden:
        raise unsupported(
            adapter.module,
            adapter.path,
            why + "with return_hidden=True it returns every layer's output, and layer-wise "
            "runs keep the top block's alone; use granularity='stack' (every layer's output "
            "over time, in Norse's order)",
        )
    if not isinstance(adapter, StackAdapter):
        if not adapter.stateful:
            raise unsupported(adapter.module, adapter.path, why + "this layer has no state")
        _check_neuron(adapter, why)
        return [Block(*_split(adapter), None)]
    blocks: list[Block] = []
    pending: list[LayerAdapter] = []
    norms: dict[int, str] = {}  # the running-statistics layers met, by module
    for i, layer in enumerate(adapter.layers):
        if isinstance(layer, StackAdapter):
            raise unsupported(
                layer.module,
                layer.path,
                why + f"it is a nested stack; flatten it into one {_container(adapter.module)}",
            )
        if layer.stateful:
            if adapter.slots[i] != i:
                raise unsupported(
                    layer.module,
                    layer.path,
                    why + f"this neuron also runs at {adapter.layers[adapter.slots[i]].path!r} "
                    "with one state threaded through both positions, so its blocks are not "
                    "feed-forward; use granularity='stack'",
                )
            _check_neuron(layer, why)
            synapses, neuron = _split(layer)
            if blocks:
                _refuse_in_place_on_a_state(blocks[-1].neuron, pending, why)
            blocks.append(Block([*pending, *synapses], neuron, i))
            pending = []
        else:
            _check_synapse(layer, why)
            _check_shared_norm(layer, norms, why)
            pending.append(layer)
    if not blocks:
        own = [
            f"{p.path!r} ({type(p.module).__name__})"
            for p in pending
            if isinstance(p, CustomLayerAdapter)
        ]
        named = f"; layers of yours it steps as stateless: {', '.join(own[:4])}" if own else ""
        raise unsupported(
            adapter.module,
            adapter.path,
            why + "the stack has no stateful layer (no neuron spikeckpt knows: a neuron of yours "
            "takes and returns its state, forward(x, state) -> (y, state); one that keeps it on "
            f"itself, self.mem = ..., is refused by granularity='stack', naming it){named}",
        )
    if pending:
        names = ", ".join(repr(p.path) for p in pending)
        raise unsupported(
            adapter.module,
            adapter.path,
            why + f"the stack ends with stateless layers after its last neuron ({names}); "
            "end it with a neuron (apply the readout layers outside the wrapped model)",
        )
    return blocks


def _container(module: nn.Module) -> str:
    """How to name ``module``'s kind of stack in a message: ``nn.Sequential``, or its own class
    (Norse's ``SequentialState``: an ``nn.Sequential`` of Norse cells returns no state)."""
    kind = type(module)
    return "nn.Sequential" if kind is nn.Sequential else kind.__name__


def _check_neuron(layer: LayerAdapter, why: str) -> None:
    if _may_draw_random(layer.module):  # a module of yours: Dropout or a draw inside
        raise unsupported(
            layer.module,
            layer.path,
            why + "this neuron module may draw random numbers (a Dropout or a random function "
            "inside it or in its spike_grad), and layer-wise replays those of Dropout synapse layers only; make the "
            "Dropout a layer of the stack before the neuron, or use granularity='stack' (which "
            "replays every random number)",
        )
    if isinstance(layer, StatefulAdapter) and layer.starts_from_none:
        container = ""
        if isinstance(layer.module, nn.Sequential):  # not a plain stack: see _is_sequential
            container = (
                "this stack has forward hooks or a forward of its own, so it runs through its "
                "call as one module of yours (register the hooks on its layers instead to "
                "step it as a stack of blocks); "
            )
        raise unsupported(
            layer.module,
            layer.path,
            why + container + "this module builds its own state from None at step 0, and "
            "layer-wise needs each block's state at t=0 as tensors; give it an initial_state(x) "
            "method or use granularity='stack'",
        )


_RANDOM_TYPES: tuple[type, ...] = tuple(
    getattr(nn, n)
    for n in ("RReLU", "FractionalMaxPool2d", "FractionalMaxPool3d")
    if hasattr(nn, n)
)
_RANDOM_NAMES = frozenset(
    (
        *("rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm"),
        *("bernoulli", "bernoulli_", "multinomial", "normal", "normal_", "uniform_"),
        *("exponential_", "geometric_", "cauchy_", "log_normal_", "poisson", "rrelu"),
        *("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout"),
        *("feature_alpha_dropout", "fractional_max_pool2d", "fractional_max_pool3d"),
    )
)


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _may_draw_random(module: nn.Module) -> bool:
    """Whether ``module`` (not a plain ``Dropout``) may draw random numbers in forward: a
    random layer type inside, or a random function named in a ``forward`` of its own."""
    for m in module.modules():
        if isinstance(m, _RANDOM_TYPES):
            return True
        if m is not module and isinstance(m, nn.modules.dropout._DropoutNd):
            return True
        fwd = getattr(type(m), "forward", None)
        code = getattr(fwd, "__code__", None)
        own = (own_class(m).__module__ or "").split(".")[0] != "torch"
        if code is not None and own and _code_names(code) & _RANDOM_NAMES:
            return True
        spike = getattr(m, "spike_grad", None)  # snnTorch's: a noisy threshold of yours
        if callable(spike) and _draws_when_called(spike):
            return True
    return False


def _draws_when_called(spike: Any) -> bool:
    """Whether a neuron's spike function draws from the CPU generator when called on a few
    membrane values (its forward; the generator forked): layer-wise recomputed it with other
    draws, 2.8-4.8% off the loop's gradients."""
    u = torch.linspace(-1.0, 1.0, 8)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        before = torch.random.get_rng_state()
        try:
            spike(u)
        except Exception:  # noqa: BLE001 - one that fails here is the run's to report
            return False
        return not torch.equal(before, torch.random.get_rng_state())


def _check_synapse(layer: LayerAdapter, why: str) -> None:
    inner = layer.inner if isinstance(layer, TimeLiftedAdapter) else layer
    if isinstance(inner.module, nn.modules.dropout._DropoutNd):
        return
    if inner.draws_random or _may_draw_random(inner.module):
        raise unsupported(
            layer.module,
            layer.path,
            why + "this synapse layer may draw random numbers, and layer-wise replays those of "
            "Dropout layers only; use granularity='stack' (which replays every random number)",
        )


def _check_shared_norm(layer: LayerAdapter, norms: dict[int, str], why: str) -> None:
    """Refuse a BatchNorm / InstanceNorm tracking running statistics at a second position
    (``norms``: those met so far, by module): layer-wise runs a block's layers over a chunk one
    after the other, and the blocks one after the other, so its statistics would be updated
    in another order than the loop's (helper h20: a BatchNorm twice in one block, running
    mean 0.025 apart, silently)."""
    module = layer.module
    if not (isinstance(module, RUNNING_STATS_TYPES) and module.track_running_stats):
        return
    first = norms.setdefault(id(module), layer.path)
    if first != layer.path:
        raise unsupported(
            module,
            layer.path,
            why + f"this {type(module).__name__} also runs at {first!r} and tracks running "
            "statistics: layer-wise calls its positions in another order than your loop "
            "(a chunk of steps at one, then at the other), so the statistics would differ; "
            "use granularity='stack'",
        )


def _is_sequential(m: nn.Module) -> bool:
    """An ``nn.Sequential`` whose call runs ``nn.Sequential``'s forward and nothing else (a
    subclass with a forward of its own, or one with forward hooks, is a module of yours: see
    `spikeckpt.adapters.generic`)."""
    return isinstance(m, nn.Sequential) and plain_container(m, nn.Sequential.forward)


def _container_error(m: nn.Module, path: str) -> LayerAdapter:
    raise unsupported(m, path, "a ModuleList/ModuleDict has no forward order; use nn.Sequential")


def registrations(adapter_for: AdapterFor) -> list[Registration]:
    """The built-in entries of this module; ``adapter_for`` (the registry's lookup) adapts
    each position of a stack."""

    def from_sequential(m: nn.Module, path: str) -> LayerAdapter:
        return StackAdapter.from_sequential(m, path, adapter_for)

    return [
        Registration(
            _is_sequential,
            from_sequential,
            "stacks",
            "nn.Sequential of any supported layers (nested allowed; a module at several "
            "positions runs at each)",
        ),
        Registration(
            lambda m: isinstance(m, (nn.ModuleList, nn.ModuleDict)), _container_error, "containers"
        ),
    ]
