"""snnTorch adapters: step neurons called in explicit-state form.

Every supported neuron is called the way snnTorch's tutorials call it, one step at a time:

- ``init_hidden=False``: ``spk, mem = lif(x_t, mem)`` (``Synaptic``: ``spk, syn, mem``, ...).
- ``init_hidden=True``: the state attributes (``lif.mem``, ...) are set before the call and
  read after it.

After each step the adapter clears what snnTorch wrote on the module (``mem``, ``syn``, ``spk``,
``reset``, ...) to empty tensors, so no state or autograd graph stays on the module or in the
class-level list ``snntorch.SpikingNeuron.instances`` between steps or batches. The state at
t=0 is zeros (what snnTorch builds itself from ``init_leaky()`` and friends).

States are NamedTuples named after snnTorch's own variables, e.g. ``LeakyState(mem)``,
``SynapticState(syn, mem)``, ``RLeakyState(spk, mem)``.

This module imports snnTorch; import it only when a snnTorch layer was found.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import snntorch as snn
import torch
from torch import Tensor, nn

from spikeckpt.adapters.alpha_kernel import AlphaKernel
from spikeckpt.adapters.generic import (
    WRITTEN_BY_CLASS,
    StatefulAdapter,
    StatelessAdapter,
    positional_params,
    refuse_kept_state,
    state_arity,
    users_subclass,
)
from spikeckpt.adapters.kernels import (
    ImmediateLeakyKernel,
    LeakyKernel,
    Reset,
    SynapticKernel,
    clamp_grad,
    read_unit_again,
)
from spikeckpt.adapters.protocol import AdapterFor, LayerAdapter, State, no_hooks, unsupported
from spikeckpt.adapters.recurrent_kernel import RecurrentKernel
from spikeckpt.adapters.snntorch_fast import fast_step, same_results
from spikeckpt.adapters.snntorch_surrogates import written_grad
from spikeckpt.engine.meter import unmetered
from spikeckpt.errors import ConfigError

__all__ = [
    "AlphaState",
    "DeltaLeakyState",
    "LeakyState",
    "RLeakyState",
    "RSynapticState",
    "SnnTorchNeuronAdapter",
    "SynapticState",
    "make_adapter",
]


class LeakyState(NamedTuple):
    """``Leaky`` / ``Lapicque``: membrane ``(B, ...)``."""

    mem: Tensor


class SynapticState(NamedTuple):
    """``Synaptic`` / ``SLSTM`` / ``SConv2dLSTM``: synaptic current and membrane."""

    syn: Tensor
    mem: Tensor


class AlphaState(NamedTuple):
    """``Alpha``: excitatory and inhibitory synaptic currents and membrane."""

    syn_exc: Tensor
    syn_inh: Tensor
    mem: Tensor


class RLeakyState(NamedTuple):
    """``RLeaky``: previous spikes (fed back through the recurrent weights) and membrane."""

    spk: Tensor
    mem: Tensor


class RSynapticState(NamedTuple):
    """``RSynaptic``: previous spikes, synaptic current and membrane."""

    spk: Tensor
    syn: Tensor
    mem: Tensor


class DeltaLeakyState(NamedTuple):
    """``DeltaLeaky``: membrane and previous membrane."""

    mem: Tensor
    mem_prev: Tensor


Init = Callable[[nn.Module, Tensor], tuple[Tensor, ...]]


def _like_input(n: int) -> Init:
    return lambda m, x: tuple(torch.zeros_like(x) for _ in range(n))


def _slstm_init(m: Any, x: Tensor) -> tuple[Tensor, ...]:
    # snnTorch's init_slstm: torch.zeros, the default dtype, not the input's (an input in
    # bfloat16 under autocast gave bfloat16 states where its loop keeps float32)
    z = torch.zeros(x.shape[0], m.hidden_size, device=x.device)
    return z, z.clone()


def _sconv_init(m: Any, x: Tensor) -> tuple[Tensor, ...]:
    z = torch.zeros(x.shape[0], m.out_channels, x.shape[2], x.shape[3], device=x.device)
    return z, z.clone()  # the default dtype, as snnTorch's init_sconv2dlstm


# Most specific classes first (DeltaLeaky subclasses Leaky).
_SPECS: list[tuple[type, type, Init]] = [
    (snn.DeltaLeaky, DeltaLeakyState, _like_input(2)),
    (snn.RLeaky, RLeakyState, _like_input(2)),
    (snn.RSynaptic, RSynapticState, _like_input(3)),
    (snn.Leaky, LeakyState, _like_input(1)),
    (snn.Lapicque, LeakyState, _like_input(1)),
    (snn.Synaptic, SynapticState, _like_input(2)),
    (snn.Alpha, AlphaState, _like_input(3)),
    (snn.SLSTM, SynapticState, _slstm_init),
    (snn.SConv2dLSTM, SynapticState, _sconv_init),
]

_SEQUENCE_ONLY = tuple(
    getattr(snn, n)
    for n in ("LeakyParallel", "StateLeaky", "LinearLeaky", "AssociativeLeaky")
    if hasattr(snn, n)
)

# Attributes snnTorch writes during a call, besides the state fields.
_SCRATCH = ("reset", "spk")


class SnnTorchNeuronAdapter(LayerAdapter):
    """One snnTorch step neuron (``init_hidden`` True or False)."""

    def __init__(self, module: nn.Module, path: str, state_cls: type, init: Init) -> None:
        super().__init__(module, path)
        self.state_cls = state_cls
        self.fields: tuple[str, ...] = state_cls._fields  # type: ignore[attr-defined]
        self._init = init
        self._packed = isinstance(module, snn.DeltaLeaky)  # state passed as one tuple
        self._names = tuple(dict.fromkeys(self.fields + _SCRATCH))
        self._spk_state = self.fields[0] == "spk"
        # in a plain nn.Sequential loop an init_hidden neuron keeps its state on itself
        self.state_on_module = bool(getattr(module, "init_hidden", False))
        self._fast = fast_step(module, state_cls)
        #: a subclass of yours: each step checks it keeps nothing more on itself
        self._subclass = users_subclass(module, "snntorch")
        #: whether the fast step matched the module's own call (checked at first use)
        self.fast_verified: bool | None = None

    def init_state(self, x_t: Tensor) -> State:
        return self.state_cls(*self._init(self.module, x_t))

    def coerce_state(self, state: State, x_t: Tensor) -> State:
        """A given state; one of another batch than ``x_t`` ``(B, ...)`` (a previous batch's
        final state) is refused: snnTorch's own call silently starts it from zeros."""
        given = state
        if isinstance(state, Tensor):
            state = (state,)
        if not isinstance(state, tuple | list) or len(state) != len(self.fields):
            held = "a tensor" if isinstance(given, Tensor) else _described(given)
            raise ConfigError(
                f"state= for layer {self.path or '<root>'} ({type(self.module).__name__}): "
                f"its state is {', '.join(self.fields)} ({len(self.fields)} tensors), got "
                f"{held}: pass {self.state_cls.__name__}({', '.join(self.fields)}) (as "
                "return_state=True returns it), a tuple in that order, or None (zeros)"
            )
        state = self.state_cls(*state)
        expected = [t.shape for t in self._init(self.module, x_t)]
        for name, value, shape in zip(self.fields, state, expected, strict=True):
            if not isinstance(value, Tensor) or value.shape == shape:
                continue
            if value.dim() == 0 or value.numel() == 0:
                continue  # init_leaky()'s empty one, a 0-d one: zeros, in the loop too
            if value.dim() == x_t.dim() >= 2 and value.shape[0] != x_t.shape[0]:
                raise ConfigError(
                    f"state= for layer {self.path or '<root>'} ({type(self.module).__name__}): "
                    f"its {name} {tuple(value.shape)} holds a batch of {value.shape[0]}, this "
                    f"call's input a batch of {x_t.shape[0]}; snnTorch's own call would "
                    f"silently start it from zeros. Pass None for this layer (zeros) or a "
                    f"state of batch {x_t.shape[0]} (e.g. a previous batch's state sliced)"
                )
            raise ConfigError(
                f"state= for layer {self.path or '<root>'} ({type(self.module).__name__}): "
                f"its {name} is {tuple(value.shape)}, where this call's input makes it "
                f"{tuple(shape)}; snnTorch's own call would silently start it from zeros. "
                f"Pass None for this layer (zeros) or a {name} of shape {tuple(shape)} (one "
                f"start for the whole batch: {name}.expand{tuple(shape)})"
            )
        return state

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        fast = self._fast
        if fast is not None and no_hooks(self.module):
            if self.fast_verified is None:
                with unmetered():  # once per neuron, not part of any step: no meter counts it
                    self.fast_verified = same_results(self.module_step, fast, self)
            if self.fast_verified:
                return fast(state, x_t)
        return self.module_step(state, x_t)

    def module_step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        """One step through the module's own call (its bookkeeping included); a subclass of
        yours that keeps more on itself (``self.count = ...``) is refused, naming it."""
        if self._subclass:
            with refuse_kept_state(self.module, self.path, self.managed):
                return self._module_step(state, x_t)
        return self._module_step(state, x_t)

    @property
    def managed(self) -> frozenset[str]:
        """The attributes a step of this neuron assigns: its state fields and snnTorch's own
        scratch (``reset``, ``spk``; ``DeltaLeaky``'s ``mem_prev`` is a state field)."""
        return frozenset(self._names)

    def _module_step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        m = self.module
        try:
            if m.init_hidden:
                for name, value in zip(self.fields, state, strict=True):
                    setattr(m, name, value)
                out = m(x_t)
                new = self.state_cls(*(getattr(m, name) for name in self.fields))
                y = out[0] if isinstance(out, tuple) else out
            elif self._packed:
                y, s = m(x_t, tuple(state))
                new = self.state_cls(*s)
            else:
                out = m(x_t, *state)
                # RLeaky/RSynaptic return (spk, mem): the spikes are output and state
                y = out[0]
                new = self.state_cls(*(out if self._spk_state else out[1:]))
        finally:
            self._clear(x_t.device)
        return new, y

    def membrane(self, state: State) -> Tensor | None:
        return state.mem

    def chunk_kernel(self) -> Kernel | None:
        """The fused recurrence of a ``Leaky``, ``Lapicque``, ``Synaptic``, ``Alpha``,
        ``RLeaky`` or ``RSynaptic`` (exactly these classes, ``reset_delay=True`` or a ``Leaky``
        with ``reset_delay=False``, a linear or one-to-one recurrence, no
        ``state_quant``, no ``inhibition``, no random surrogate, a spike function firing at
        ``u > 0`` as snnTorch's do, the library's own ``forward`` and state function), else
        None."""
        return snntorch_kernel(self.module)

    def call_outputs(self, state: State) -> tuple[Any, ...] | None:
        """With ``init_hidden=True``, what ``net(x_t)`` returns after the spikes when this
        neuron ends the net: ``output=True`` gives the state fields in snnTorch's order
        (``spk, mem``; ``spk, syn, mem``; Alpha ``spk, syn_exc, syn_inh, mem``); ``DeltaLeaky``
        always returns ``spk, (mem, mem_prev)``. None otherwise (the call returns ``spk``;
        with ``init_hidden=False`` the call takes and returns the state explicitly, and the
        wrapped model returns the spikes: ``output="both"`` adds the membrane)."""
        if not self.returns_more:
            return None
        if self._packed:
            return (tuple(state),)
        return tuple(getattr(state, name) for name in self.fields if name != "spk")

    @property
    def returns_more(self) -> bool:
        m = self.module
        return bool(getattr(m, "init_hidden", False)) and (
            self._packed or bool(getattr(m, "output", False))
        )

    def put_state(self, state: State) -> None:
        """Set the state on the module (``init_hidden=True``: the module's own call reads it)."""
        for name, value in zip(self.fields, state, strict=True):
            setattr(self.module, name, value)

    def take_state(self) -> State:
        """The state the module's own call left on it (``init_hidden=True``)."""
        return self.state_cls(*(getattr(self.module, name) for name in self.fields))

    def check(self) -> None:
        _check_buffers(self)  # also one assigned after wrapping (lif.beta = sigmoid(raw))
        graded = getattr(self.module, "graded_spikes_factor", None)
        if isinstance(graded, Tensor):  # read at this forward (``.data`` writes since)
            read_unit_again(graded)

    def cleanup(self) -> None:
        mem = getattr(self.module, "mem", None)
        self._clear(mem.device if isinstance(mem, Tensor) else torch.device("cpu"))

    def _clear(self, device: torch.device) -> None:
        """Replace what the call wrote on the module by empty values (no state, no graph)."""
        packed = self.fields if self._packed else ()
        clear_written(self.module, self._names, device, packed)


def clear_written(
    m: nn.Module, names: tuple[str, ...], device: torch.device, to_none: tuple[str, ...] = ()
) -> None:
    """Replace the tensors a snnTorch call wrote on ``m`` under ``names`` by empty ones (no
    state, no graph kept between calls); ``to_none`` by None (``DeltaLeaky`` tests ``self.mem
    is None``)."""
    for name in names:
        empty: Any = None if name in to_none else torch.zeros(0, device=device)
        if name in m._buffers:
            m._buffers[name] = empty
        elif isinstance(m.__dict__.get(name), Tensor):
            m.__dict__[name] = empty


#: every attribute snnTorch's neurons write during a call: their state fields and scratch
_WRITTEN: tuple[str, ...] = tuple(
    dict.fromkeys([*(f for _, c, _ in _SPECS for f in c._fields), *_SCRATCH])  # type: ignore[attr-defined]
)


# a neuron inside a module of yours is checked by that module's adapter: its state skipped
WRITTEN_BY_CLASS[snn.SpikingNeuron] = frozenset(_WRITTEN)


class UsersNeuronAdapter(StatefulAdapter):
    """A neuron of yours built on snnTorch's classes (``class MyLIF(snn.LIF)``) with its own
    ``forward(input_, s1, ..., sk) -> (spk, s1, ..., sk)``, stepped by arity as any module of
    yours; what snnTorch's helpers write on the module (``self.mem``, ``self.reset``) is
    cleared after each call, anything more kept on it is refused, naming it."""

    written = frozenset(_WRITTEN)

    def init_state(self, x_t: Tensor) -> State:
        try:
            return super().init_state(x_t)
        finally:
            clear_written(self.module, _WRITTEN, x_t.device)

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        try:
            with refuse_kept_state(self.module, self.path, frozenset(_WRITTEN)):
                return super().step(state, x_t)
        finally:
            clear_written(self.module, _WRITTEN, x_t.device)


def _check_buffers(adapter: SnnTorchNeuronAdapter) -> None:
    """Reject buffers that carry an autograd graph: computed once from a parameter, when
    the layer was built (snnTorch 1.0.0's ``Lapicque(learn_beta=True)`` computes ``C`` from
    ``beta``: a second backward fails) or by you before the call (``lif.beta =
    torch.sigmoid(raw)``: the engine differentiates tensors, not a graph made before the
    call; a parametrization computes it at each step)."""
    m = adapter.module
    for name, buf in m._buffers.items():
        if name not in adapter._names and isinstance(buf, Tensor) and buf.grad_fn is not None:
            fix = (
                "snnTorch computes it when the layer is built (Lapicque(learn_beta=True) "
                "computes C from beta): learn beta with Leaky, or keep it fixed"
                if name == "C"
                else "compute it at each step instead: make the raw value the learnable "
                f"tensor and register the function as a parametrization (lif.{name} = "
                "nn.Parameter(raw_init); torch.nn.utils.parametrize.register_parametrization("
                f"lif, {name!r}, nn.Sigmoid())), or pass learn_{name}=True"
            )
            raise unsupported(
                m,
                adapter.path,
                f"its buffer {name!r} holds an autograd graph made before the call (computed "
                f"from a parameter once: lif.{name} = torch.sigmoid(raw) assigned before the "
                f"call does so); gradients through it can be taken only once; {fix}",
            )


def make_adapter(module: nn.Module, path: str, adapter_for: AdapterFor) -> LayerAdapter:
    """The adapter for a snnTorch layer, or raise [`UnsupportedLayerError`][spikeckpt.errors.UnsupportedLayerError].

    ``adapter_for`` is the registry's lookup (unused: snnTorch's layers hold no children that
    need adapting; containers are stacks, handled by the registry)."""
    if _SEQUENCE_ONLY and isinstance(module, _SEQUENCE_ONLY):
        raise unsupported(
            module,
            path,
            "it takes the whole (T, B, C) sequence at once and has no per-step API or initial "
            "state; use snn.Leaky (same dynamics, one step per call)",
        )
    if isinstance(module, snn.SLSTM) and module.input_size != module.hidden_size:
        raise unsupported(
            module,
            path,
            f"snnTorch's SLSTM drops the state it is given when input_size ({module.input_size})"
            f" != hidden_size ({module.hidden_size}) (a snnTorch bug: it compares the state's "
            "shape with the input's); put an nn.Linear(input_size, hidden_size) before an SLSTM "
            "with equal sizes",
        )
    for cls, state_cls, init in _SPECS:
        if isinstance(module, cls):
            if _own_call(module, cls):
                return _users_neuron(module, path, cls)
            adapter = SnnTorchNeuronAdapter(module, path, state_cls, init)
            _check_buffers(adapter)
            return adapter
    if isinstance(module, snn.GradedSpikes):
        return StatelessAdapter(module, path)
    if users_subclass(module, "snntorch") and isinstance(module, snn.SpikingNeuron):
        return _users_neuron(module, path, snn.SpikingNeuron)
    raise unsupported(module, path, "this snnTorch layer has no step adapter")


def _n_positional(fn: Any) -> int | None:
    """How many positional arguments ``fn`` takes (``self`` included where unbound); None
    where it takes ``*args`` (any number) or its signature cannot be read."""
    found = positional_params(fn)
    return None if found is None or found[1] else len(found[0])


def _own_call(module: nn.Module, base: type) -> bool:
    """Whether a subclass of yours of snnTorch's ``base`` replaces its forward with one that
    takes other arguments (``forward(input_, mem, a)`` on a ``Leaky``): then its states are
    not ``base``'s, and it is stepped by arity as a neuron of yours. A forward taking
    ``*args`` passes them on: ``base``'s call."""
    forward, own = type(module).forward, getattr(base, "forward", None)
    if not users_subclass(module, "snntorch") or forward is own:
        return False
    n = _n_positional(forward)
    return n is not None and n != _n_positional(own)


def _users_neuron(module: nn.Module, path: str, base: type) -> UsersNeuronAdapter:
    """The adapter of a neuron of yours built on snnTorch's ``base``, or a clear refusal."""
    kind = f"a neuron of yours built on snnTorch's {base.__name__}"
    if getattr(module, "init_hidden", False):
        raise unsupported(
            module,
            path,
            f"{kind} with init_hidden=True keeps its state on itself, which spikeckpt steps "
            "only for snnTorch's own neurons; build it with init_hidden=False and a forward "
            "that takes and returns its state: forward(input_, mem) -> (spk, mem)",
        )
    if state_arity(module) < 1:
        raise unsupported(
            module,
            path,
            f"{kind} whose forward takes no state after the input; spikeckpt steps a neuron "
            "of yours through forward(input_, s1, ..., sk) -> (spk, s1, ..., sk): take the "
            "state and return it (forward(input_, mem) -> (spk, mem))",
        )
    return UsersNeuronAdapter(module, path)


#: the chunk kernels of snnTorch's neurons
Kernel = LeakyKernel | ImmediateLeakyKernel | SynapticKernel | AlphaKernel | RecurrentKernel

#: the reset mechanisms as the kernels name them, per class (``Leaky`` resets to zero before
#: the decay, ``Lapicque`` and ``Synaptic`` after it)
_RESETS: dict[type, dict[str, Reset]] = {
    snn.Leaky: {"subtract": "subtract", "zero": "zero_before", "none": "none"},
    snn.Lapicque: {"subtract": "subtract", "zero": "zero_after", "none": "none"},
    snn.Synaptic: {"subtract": "subtract", "zero": "zero_after", "none": "none"},
    snn.Alpha: {"subtract": "subtract", "zero": "zero_after", "none": "none"},
    snn.RLeaky: {"subtract": "subtract", "zero": "zero_after", "none": "none"},
    snn.RSynaptic: {"subtract": "subtract", "zero": "zero_after", "none": "none"},
}
#: snnTorch surrogates that draw random numbers in backward (or fail): never fused
_RANDOM_SURROGATES = ("SSO", "LSO")
#: membrane-minus-threshold values on which a spike function must give snnTorch's heaviside
#: ``(u > 0).float()``: the kernels compute the spikes so, never calling it; a user's own
#: surrogate firing at ``u >= 0`` differs only at the threshold itself, which a membrane
#: reaches exactly on coarse values (binary inputs, weights such as 0.5)
_HEAVISIDE_PROBE = (-2.0, -1e-30, -0.0, 0.0, 1e-30, 2.0)


def snntorch_kernel(
    m: Any,
) -> Kernel | None:
    """The chunk kernel for the snnTorch neuron ``m`` (see
    `SnnTorchNeuronAdapter.chunk_kernel`), or None."""
    cls = type(m)
    resets = _RESETS.get(cls)
    if resets is None or "forward" in vars(m):
        return None
    spike = m.spike_grad
    name = getattr(spike, "__qualname__", "")
    immediate = not getattr(m, "reset_delay", True)
    if (
        getattr(m, "state_quant", True)
        or getattr(m, "inhibition", True)
        or (immediate and cls is not snn.Leaky)
        or any(name.startswith(bad) for bad in _RANDOM_SURROGATES)
        or not _fires_above_zero(spike)
        or not _passes_gradient(spike)
    ):
        return None
    mechanism = m.reset_mechanism
    function = getattr(m.state_function, "__func__", None)
    if mechanism not in resets or function is not getattr(cls, _STATE_FUNCTIONS[mechanism]):
        return None
    reset = resets[mechanism]
    written = written_grad(spike)
    if immediate and reset != "none":  # Leaky(reset_delay=False); "none" has no reset to do
        return ImmediateLeakyKernel(
            lambda: (m.beta, m.threshold, m.graded_spikes_factor), spike, reset, written
        )
    if cls in (snn.RLeaky, snn.RSynaptic):
        return _recurrent_kernel(m, spike, reset, written)
    if cls in (snn.Alpha, snn.Synaptic):  # two decays: alpha, beta
        return (AlphaKernel if cls is snn.Alpha else SynapticKernel)(
            lambda: (m.alpha, m.beta, m.threshold, m.graded_spikes_factor),
            spike,
            reset,
            spike_grad=written,
        )
    if cls is snn.Leaky:
        return LeakyKernel(
            lambda: (m.beta, m.threshold, m.graded_spikes_factor),
            lambda beta: beta.clamp(0, 1),
            clamp_grad,
            spike,
            reset,
            spike_grad=written,
        )
    # Lapicque: mem = z * R * (1 / (R * C)) * time_step + (1 - time_step / (R * C)) * mem
    return LeakyKernel(
        lambda: (m.R, m.threshold, m.graded_spikes_factor),
        lambda R: 1 - (m.time_step / (R * m.C)),
        None,
        spike,
        reset,
        input_scale=lambda z: z * m.R * (1 / (m.R * m.C)) * m.time_step,
        frozen=lambda: (m.C, m.time_step),
        spike_grad=written,
    )


def _spike_on(spike: Callable[[Tensor], Tensor], *, requires_grad: bool) -> Tensor | None:
    """``spike`` called on `_HEAVISIDE_PROBE` (a membrane that requires grad or not), its
    random numbers not taken from the run's stream; None where it fails or returns no tensor
    (such a spike function steps per call)."""
    u = torch.tensor(_HEAVISIDE_PROBE, requires_grad=requires_grad)
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]), unmetered():
            out = spike(u)
    except Exception:  # noqa: BLE001 - a spike function that fails here steps per call
        return None
    return out if isinstance(out, Tensor) else None


def _fires_above_zero(spike: Callable[[Tensor], Tensor]) -> bool:
    """Whether ``spike``'s forward is snnTorch's heaviside ``(u > 0).float()`` on
    `_HEAVISIDE_PROBE` (every snnTorch surrogate's is; a user's may fire at ``u >= 0``) and
    its output has no gradient but through ``u``: a surrogate with a learnable slope of its
    own (``sigmoid(k * u) - sigmoid(k * u).detach()``) gave ``k`` no gradient in the kernel,
    which takes the surrogate's gradient with respect to ``u`` only."""
    out = _spike_on(spike, requires_grad=False)  # an output that requires grad depends on more
    if out is None or out.requires_grad:
        return False
    u = torch.tensor(_HEAVISIDE_PROBE)
    return out.dtype == u.dtype and torch.equal(out, (u > 0).float())


def _passes_gradient(spike: Callable[[Tensor], Tensor]) -> bool:
    """Whether ``spike``'s output has a gradient with respect to the membrane. One without
    (``surrogate_disable=True``, ``lambda u: (u > 0).float()``) cuts the graph in your loop:
    the layers before it get no ``.grad`` (None), where the kernel would hand them zeros,
    which an optimizer with weight decay or momentum treats otherwise (AdamW moved a weight
    the loop left alone by 3.2e-4 in one step). Such a neuron steps per call."""
    out = _spike_on(spike, requires_grad=True)
    return out is not None and out.requires_grad


def _recurrent_kernel(
    m: Any, spike: Any, reset: Reset, written: Callable[[Tensor, Tensor], Tensor] | None
) -> RecurrentKernel | None:
    """``RLeaky``'s or ``RSynaptic``'s kernel where its recurrent map is torch's own
    ``Linear`` (``all_to_all=True`` with ``linear_features``) or snnTorch's one-to-one ``spk *
    V``, with no forward hook; None for a convolutional one (it steps per call)."""
    rec: Any = getattr(m, "recurrent", None)
    synaptic = isinstance(m, snn.RSynaptic)

    def decays() -> tuple[Tensor, ...]:
        return (m.alpha, m.beta) if synaptic else (m.beta,)

    if type(rec) is nn.Linear:
        return RecurrentKernel(
            lambda: (*decays(), m.threshold, m.graded_spikes_factor, rec.weight, rec.bias),
            True,
            spike,
            reset,
            written,
            usable=lambda: m.recurrent is rec and no_hooks(rec),
            synaptic=synaptic,
        )
    one_to_one = type(rec).__name__ == "RecurrentOneToOne" and "forward" not in vars(rec)
    if one_to_one and isinstance(getattr(rec, "V", None), Tensor):
        return RecurrentKernel(
            lambda: (*decays(), m.threshold, m.graded_spikes_factor, rec.V),
            False,
            spike,
            reset,
            written,
            usable=lambda: m.recurrent is rec and no_hooks(rec) and isinstance(rec.V, Tensor),
            synaptic=synaptic,
        )
    return None


_STATE_FUNCTIONS = {"subtract": "_base_sub", "zero": "_base_zero", "none": "_base_int"}


def _described(state: Any) -> str:
    """What a given state is, for a message: ``"3 entries"``, or its type's name."""
    if isinstance(state, tuple | list):
        return f"{len(state)} entries"
    return type(state).__name__
