"""Norse adapters: cells, sequence modules, ``Lift`` and ``SequentialState``.

- Cells (any ``SNNCell`` / ``SNNRecurrentCell``: ``LIFCell``, ``LIFRecurrentCell``,
  ``LIFBoxCell``, ``LIFAdExCell``, ``LIFExCell``, ``LIFRefracCell``, ``LICell``, ``LSNNCell``,
  ``IzhikevichCell``, ...) are called as in Norse's tutorials: ``z, state = cell(x_t, state)``.
- Sequence modules (any ``SNN`` / ``SNNRecurrent``: ``LIF``, ``LIFRecurrent``, ``LI``, ...) are
  stepped through their activation, as their own loop does:
  ``activation(x[t], state, p, dt)`` (recurrent: ``activation(x[t], state, w_in, w_rec, p, dt)``).
- ``Lift(m)`` steps ``m``; ``SequentialState`` becomes a stack (its state list is never passed
  to Norse, so Norse cannot mutate it).

The state at t=0 is Norse's own initial state (``module.initial_state``), detached and
broadcast to the shapes and dtypes of the state after one step (Norse starts ``v`` as a 0-d
``v_leak`` and the currents as float32; scan needs one shape and dtype per state leaf).

Norse keeps neuron parameters in a plain NamedTuple ``module.p`` that ``.to()`` does not move;
the adapter moves its tensors to the input's device at call time, in their own dtype (Norse's
own loop computes with them as they are: a float32 ``p`` beside a bf16 input under autocast, or
in a float64 model, promotes or rounds as torch does, and a cast copy would round otherwise),
and adds any of them that require grad (``LIFParameters(tau_mem_inv=nn.Parameter(...))``) to the
parameters scan differentiates.

This module imports Norse; import it only when a Norse layer was found.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from norse.torch.module.coba_lif import CobaLIFCell
from norse.torch.module.leaky_integrator import LILinearCell
from norse.torch.module.lift import Lift
from norse.torch.module.sequential import SequentialState
from norse.torch.module.snn import SNN, SNNCell, SNNRecurrent, SNNRecurrentCell
from torch import Tensor, nn

from spikeckpt.adapters.adex_kernel import NorseExKernel
from spikeckpt.adapters.adex_refrac_kernel import NorseAdExRefracKernel
from spikeckpt.adapters.ex_recurrent_kernel import NorseExRecurrentKernel
from spikeckpt.adapters.generic import (
    StatefulAdapter,
    StatelessAdapter,
    own_loop_error,
    probe,
    refuse_kept_state,
    state_arity,
    users_subclass,
)
from spikeckpt.adapters.izhikevich_kernel import NorseIzhikevichKernel
from spikeckpt.adapters.kernels import NorseKernel, NorseMode
from spikeckpt.adapters.lsnn_kernel import NorseLSNNFeedForwardKernel, NorseLSNNKernel
from spikeckpt.adapters.norse_coba import CobaLIFAdapter
from spikeckpt.adapters.norse_li_linear import LILinearAdapter
from spikeckpt.adapters.norse_params import is_namedtuple, move_params
from spikeckpt.adapters.norse_surrogates import host_slope, written_norse_grad
from spikeckpt.adapters.protocol import (
    AdapterFor,
    LayerAdapter,
    State,
    no_hooks,
    plain_container,
    unsupported,
)
from spikeckpt.adapters.recurrent_kernel import NorseRecurrentKernel
from spikeckpt.adapters.refrac_kernel import NorseRefracKernel
from spikeckpt.adapters.refrac_recurrent_kernel import NorseRefracRecurrentKernel
from spikeckpt.adapters.simple_kernels import (
    NorseCobaKernel,
    NorseIAFKernel,
    NorseLIBoxKernel,
    simple_kernel,
)
from spikeckpt.engine import tree as pytree
from spikeckpt.engine.rng import kept_generators
from spikeckpt.errors import ConfigTypeError

__all__ = ["NorseAdapter", "make_adapter", "move_params", "sequence_dropouts"]

#: the chunk kernels of Norse's steps
NorseChunkKernel = (
    NorseKernel
    | NorseLSNNFeedForwardKernel
    | NorseExKernel
    | NorseRecurrentKernel
    | NorseLSNNKernel
    | NorseExRecurrentKernel
    | NorseRefracRecurrentKernel
    | NorseIAFKernel
    | NorseLIBoxKernel
    | NorseCobaKernel
    | NorseIzhikevichKernel
    | NorseRefracKernel
    | NorseAdExRefracKernel
)
#: the kernels of the feed-forward steps
FeedForwardKernel = (
    NorseKernel
    | NorseLSNNFeedForwardKernel
    | NorseExKernel
    | NorseIAFKernel
    | NorseLIBoxKernel
    | NorseCobaKernel
    | NorseIzhikevichKernel
    | NorseRefracKernel
    | NorseAdExRefracKernel
)

_SEQUENCE = (SNN, SNNRecurrent)
_RECURRENT = (SNNRecurrentCell, SNNRecurrent)


def _tensors(p: Any) -> list[Tensor]:
    if isinstance(p, Tensor):
        return [p]
    if isinstance(p, tuple):
        return [t for f in p for t in _tensors(f)]
    return []


def _conform(init: Any, nxt: Any, module: nn.Module, path: str) -> Any:
    """``init`` with each leaf broadcast to the shape and cast to the dtype of ``nxt``'s leaf.
    A fresh leaf is detached (Norse marks its initial ``v`` as requiring grad; nothing reads
    that gradient); an ``nn.Parameter`` (``IzhikevichCell`` starts from its behaviour's ``s``
    itself, which a user may make learnable), one of ``p``'s tensors taking a gradient, or a
    tensor with a graph to them (a subclass starting from ``self.v0.expand(...)``) keeps its
    path: in Norse's loop the gradient reaches
    them through the start too (``IAFCell`` starts ``v`` at ``p.v_reset`` itself)."""
    leaves, spec = pytree.tree_flatten(init)
    nxt_leaves, nxt_spec = pytree.tree_flatten(nxt)
    if spec != nxt_spec:
        raise unsupported(module, path, "its state changes structure after one step")
    own = {id(t) for t in _tensors(getattr(module, "p", None)) if t.requires_grad}
    own |= {id(t) for t in module.parameters() if t.requires_grad}
    out = []
    for a, b in zip(leaves, nxt_leaves, strict=True):
        if isinstance(a, Tensor) and isinstance(b, Tensor):
            kept = id(a) in own or isinstance(a, nn.Parameter) or not a.is_leaf
            if not (kept and a.requires_grad):
                a = a.detach()
            if a.shape != b.shape:
                a = a.expand(b.shape)
            a = a.to(dtype=b.dtype, device=b.device).clone()
        out.append(a)
    return pytree.tree_unflatten(out, spec)


def _reads_input(module: nn.Module, fallback: Callable[[Tensor], Any], x_t: Tensor) -> bool:
    """Whether a cell's ``initial_state`` (``fallback``) reads ``x_t``'s values, not only its
    shape: called on ``x_t`` and on other values, each from the same random state (torch's
    default generators and the ``torch.Generator`` objects ``module`` holds)."""
    devices = [x_t.device.index or 0] if x_t.is_cuda else []
    with torch.no_grad():
        with torch.random.fork_rng(devices=devices), kept_generators(module):
            same = fallback(x_t)
        with torch.random.fork_rng(devices=devices), kept_generators(module):
            other = fallback(x_t + 0.5)
    a, b = pytree.tree_leaves(same), pytree.tree_leaves(other)
    return len(a) != len(b) or any(
        isinstance(u, Tensor) and isinstance(v, Tensor) and not torch.equal(u, v)
        for u, v in zip(a, b, strict=False)
    )


def _field(state: Any, name: str) -> Tensor | None:
    """The first field called ``name`` in a (nested) NamedTuple state."""
    if is_namedtuple(state):
        if name in state._fields:
            return getattr(state, name)
        for sub in state:
            found = _field(sub, name)
            if found is not None:
                return found
    return None


class NorseAdapter(LayerAdapter):
    """A Norse cell (``sequence=False``) or sequence module (``sequence=True``), one step."""

    returns_state = True

    def __init__(self, module: nn.Module, path: str) -> None:
        super().__init__(module, path)
        self.sequence = isinstance(module, _SEQUENCE)
        self.recurrent = isinstance(module, _RECURRENT)
        #: a subclass of yours: each step checks it keeps nothing more on itself
        self._subclass = users_subclass(module, "norse")

    def init_state(self, x_t: Tensor) -> State:
        m: Any = self.module  # Norse's cell: untyped attributes
        first = x_t.unsqueeze(0) if self.sequence else x_t
        if self._subclass and _reads_input(m, m.state_fallback, first):
            raise unsupported(
                m,
                self.path,
                "its initial_state reads its input's values (Norse calls initial_state(x_0) "
                "at step 0), and a wrapped run makes the start before the run, without a "
                "graph to the layers before it: their gradients would miss that path. Pass "
                "the start yourself: seq(x, state) with this cell's state made from its "
                "step-0 input (a graph the run then differentiates)",
            )
        init = m.state_fallback(first)
        after, _ = probe(self.step, init, x_t)
        return _conform(init, after, m, self.path)

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        if self._subclass:  # one keeping more on itself is refused
            with refuse_kept_state(self.module, self.path):
                return self._step(state, x_t)
        return self._step(state, x_t)

    def _step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        m: Any = self.module  # Norse's cell: untyped attributes
        p = move_params(m.p, x_t.device)
        if self.sequence:
            sparse = m.activation_sparse is not None and x_t.is_sparse
            act = m.activation_sparse if sparse else m.activation
            if self.recurrent:
                z, s = act(x_t, state, m.input_weights, m.recurrent_weights, p, m.dt)
            else:
                z, s = act(x_t, state, p, m.dt)
            return s, z
        if p is m.p:
            z, s = m(x_t, state)
            return s, z
        old, m.p = m.p, p
        try:
            z, s = m(x_t, state)
        finally:
            m.p = old
        return s, z

    def membrane(self, state: State) -> Tensor | None:
        return _field(state, "v")

    def check(self) -> None:
        if self.sequence:
            self._check_sequence()

    def _check_sequence(self) -> None:
        """A sequence module is stepped through its activation, never called: refuse what
        its own call would add (a ``forward`` of its own, forward hooks) or change
        (``record_states``)."""
        m = self.module
        if type(m).forward not in (SNN.forward, SNNRecurrent.forward) or "forward" in vars(m):
            raise unsupported(
                m,
                self.path,
                f"{type(m).__name__} overrides Norse's forward, and a sequence module is stepped "
                "through its activation (its forward, which loops over time, cannot be called "
                "one step at a time): put what your forward adds in the step instead, e.g. a "
                "cell subclass (norse.LIFCell) whose forward(x_t, state) does it, or your own "
                "module with forward(x_t, state) -> (z, state)",
            )
        if not no_hooks(m):
            raise unsupported(
                m,
                self.path,
                "it has forward hooks or backward hooks (its own or global ones), and a sequence "
                "module is stepped through its activation, never called on the whole sequence: "
                "the hooks would not run; remove them, or use the cell (norse.LIFCell for "
                "norse.LIF, ...), whose call runs at each step, with its hooks",
            )
        if getattr(m, "record_states", False):
            raise unsupported(
                m,
                self.path,
                "record_states=True makes its call return every step's state stacked over "
                "time instead of the final state, which a wrapped model returns (it keeps a "
                "few states, not T); set record_states=False, and for the membrane over time "
                "use spikeckpt.wrap(..., output='mem') or 'both', or spikeckpt.scan with a step "
                "that returns the state as its output",
            )

    def extra_params(self) -> list[Tensor]:
        found = {id(t): t for t in _tensors(self.module.p) if t.requires_grad}
        for t in super().extra_params():
            found.setdefault(id(t), t)
        return list(found.values())

    def chunk_kernel(self) -> NorseChunkKernel | None:
        """The fused recurrence of a feed-forward cell or sequence module whose activation is
        Norse's ``lif_feed_forward_step``, ``lif_box_feed_forward_step`` (resetting with
        ``reset_value`` or ``reset_subtract``), ``li_feed_forward_step``,
        ``lsnn_feed_forward_step``, ``lif_ex_feed_forward_step``,
        ``lif_adex_feed_forward_step``, ``iaf_feed_forward_step``, ``li_box_feed_forward_step``,
        ``coba_lif_feed_forward_step``, ``izhikevich_feed_forward_step``,
        ``lif_refrac_feed_forward_step`` or ``lif_adex_refrac_feed_forward_step``, or of a
        ``LIFRecurrentCell`` (``lif_step``), ``LSNNRecurrentCell`` (``lsnn_step``),
        ``LIFExRecurrentCell`` (``lif_ex_step``), ``LIFAdExRecurrentCell``
        (``lif_adex_step``), ``LIFRefracRecurrentCell`` (``lif_refrac_step``) or
        ``LIFAdExRefracRecurrentCell`` (``lif_adex_refrac_step``), else None."""
        if self.recurrent:
            return norse_recurrent_kernel(self.module)
        return norse_kernel(self.module)


def stack_options(module: nn.Module, path: str = "") -> dict[str, Any] | None:
    """For a ``SequentialState`` (a plain one: `_plain_stack`) at ``path``: how to build its
    stack (keyword arguments of `from_sequential`); else ``None``.

    Norse passes one state per position (``stateful_flags``: its ``stateful_layers``, a module
    Norse calls without a state is stepped without one); in sequence mode its plain layers see
    ``(T, B, ...)`` tensors; ``return_hidden=True`` makes each step's output the list of every
    position's output (the wrapped model returns each one over time, in Norse's order). A
    cell beside sequence modules is refused (`_refuse_cells_in_sequence`)."""
    if not _plain_stack(module):
        return None
    flags = getattr(module, "stateful_layers", None)
    sequence_mode = is_sequence_stack(module)
    if sequence_mode:
        _refuse_cells_in_sequence(module, path)
    return {
        "sequence_mode": sequence_mode,
        "stateful_flags": list(flags) if flags is not None else [True] * len(module._modules),
        "return_hidden": bool(getattr(module, "return_hidden", False)),
        "lifted": [isinstance(c, Lift) for c in module._modules.values() if c is not None],
    }


def _refuse_cells_in_sequence(module: nn.Module, path: str) -> None:
    """Refuse a bare cell in a ``SequentialState`` of sequence modules (``LIF``, ``LI``,
    ``Lift``): Norse's call hands it the whole sequence ``(T, B, ...)`` as one step (``T`` a
    batch dimension), where spikeckpt would step it over time: the outputs would differ."""
    import norse.torch as nt

    sequences = [
        f"{type(c).__name__} at {n!r}"
        for n, c in module.named_children()
        if isinstance(c, (*_SEQUENCE, Lift))
    ]
    for name, child in module.named_children():
        if not isinstance(child, (SNNCell, SNNRecurrentCell, LILinearCell, CobaLIFCell)):
            continue
        cell = type(child).__name__
        sequence = cell.removesuffix("Cell")
        way = f"use its sequence module {sequence}(...), or " if hasattr(nt, sequence) else ""
        raise unsupported(
            child,
            f"{path}.{name}" if path else name,
            f"this cell sits beside sequence modules ({', '.join(sequences[:3])}), so Norse's "
            "call of the SequentialState hands it the whole sequence (T, B, ...) as one step, "
            "and the wrapped model (which would step it over time) would differ from it; "
            f"{way}make every layer a cell (LI -> LICell), which the wrapped model steps over "
            "time as your per-step loop does",
        )


def _plain_stack(module: nn.Module) -> bool:
    """A ``SequentialState`` that Norse's own ``forward`` runs, with no forward hooks: it is
    stepped as a stack of its layers. Another one (a subclass with a ``forward`` of its own,
    or hooks on it) is a module of yours with ``forward(x_t, state) -> (z, state)``: stepped
    through its call, so what its forward or hooks add runs at each step, as in Norse's loop
    (the stack granularity; layer-wise needs a stack of blocks)."""
    return isinstance(module, SequentialState) and plain_container(module, SequentialState.forward)


def make_adapter(module: nn.Module, path: str, adapter_for: AdapterFor) -> LayerAdapter:
    """The adapter for a Norse layer other than ``SequentialState`` (see
    `stack_options`), or raise [`UnsupportedLayerError`][spikeckpt.errors.UnsupportedLayerError] (``adapter_for``: the
    registry's lookup, for the module inside ``Lift``)."""
    if _plain_stack(module):
        raise ConfigTypeError(
            "a SequentialState is a stack: the registry builds it (stack_options)"
        )
    if isinstance(module, (SNNCell, SNNRecurrentCell, SNN, SNNRecurrent)):
        return NorseAdapter(module, path)
    if isinstance(module, LILinearCell):
        return LILinearAdapter(module, path)
    if isinstance(module, CobaLIFCell):
        return CobaLIFAdapter(module, path)
    if isinstance(module, Lift):
        sub = f"{path}.lifted_module" if path else "lifted_module"
        return adapter_for(module.lifted_module, sub)
    if state_arity(module):
        return StatefulAdapter(module, path)
    step_encoder = _step_encoder(module)
    if step_encoder is not None:
        return step_encoder(module, path)
    stateful = (SNNCell, SNNRecurrentCell, SNN, SNNRecurrent, LILinearCell, CobaLIFCell)
    inside = [n for n, m in module.named_modules() if n and isinstance(m, stateful)]
    if inside:  # a model of Norse's (norse.torch.models: ConvNet4, ...) with its own loop
        raise own_loop_error(
            module,
            path,
            f"its forward(x) runs layers that keep state over time ({', '.join(inside[:4])}) "
            "in a time loop of its own, so one call is not one time step",
        )
    if type(module).__module__ == "norse.torch.module.encode":
        raise unsupported(
            module,
            path,
            "this Norse encoder makes a whole sequence from its input, so one call is not one "
            "time step; encode before the wrapped model (x = encoder(inputs), (T, B, ...); "
            "seq(x)), or, for Poisson spikes drawn at each step inside it, use "
            "norse.torch.module.encode.PoissonEncoderStep (or SignedPoissonEncoderStep)",
        )
    raise unsupported(
        module,
        path,
        "this Norse module has no per-step form (x, state) -> "
        "(z, state); encoders and whole-sequence modules cannot be stepped",
    )


class NorseEncoderStepAdapter(StatelessAdapter):
    """A Norse encoder of one time step (``PopulationEncoder``): ``y_t = module(x_t)``, no
    state; the input ``x_t (B, ...)``, its code ``(B, ..., out_features)``."""


class NorsePoissonStepAdapter(NorseEncoderStepAdapter):
    """``PoissonEncoderStep`` / ``SignedPoissonEncoderStep``: one step's spikes ``(B, ...)``
    drawn from torch's generator with probability ``f_max * dt * x_t``; the stack replays the
    draws when it recomputes a step; layer-wise refuses it (it replays Dropout's only)."""

    draws_random = True


def _step_encoder(module: nn.Module) -> type[LayerAdapter] | None:
    """The adapter class of Norse's encoders of one time step (no state, one step in, one
    step out), or None for other modules."""
    from norse.torch.module import encode

    if not no_hooks(module) or type(module).forward not in (
        encode.PoissonEncoderStep.forward,
        encode.SignedPoissonEncoderStep.forward,
        encode.PopulationEncoder.forward,
    ):
        return None
    if isinstance(module, encode.PopulationEncoder):
        return NorseEncoderStepAdapter
    return NorsePoissonStepAdapter


def is_sequence_stack(module: nn.Module) -> bool:
    """Whether a ``SequentialState`` holds sequence modules (``LIF``, ``Lift``, ...): its plain
    torch layers then see ``(T, B, ...)`` tensors and are stepped on ``x_t[None]``."""
    return any(isinstance(c, (*_SEQUENCE, Lift)) for c in module.children())


#: ``p.method`` values whose spike the fused kernel takes from Norse's ``threshold``.
#: Not ``"heaviside"``: its spike has no gradient, so in Norse's loop nothing below it gets
#: one (``.grad`` stays None and an optimizer skips the layer); the kernel's backward computed
#: zeros there, which AdamW's weight decay then applied. Such a cell runs per step.
_METHODS = ("super", "tanh", "triangle", "circ", "heavi_erfc")


def _norse_spike(m: Any) -> Callable[[Tensor], Tensor]:
    """``u -> threshold(u, method, alpha)`` with ``m.p`` read at each call."""
    from norse.torch.functional.threshold import threshold

    def spike(u: Tensor) -> Tensor:
        return threshold(u, m.p.method, m.p.alpha)

    spike.written_grad = lambda: written_norse_grad(m.p.method, m.p.alpha)  # type: ignore[attr-defined]
    spike.host_slope = lambda: host_slope(m.p.method)  # type: ignore[attr-defined]
    return spike


def _norse_lif_spike(m: nn.Module, field: str = "lif") -> Callable[[Tensor], Tensor]:
    """``u -> threshold(u, method, alpha)`` of ``m.p.lif`` (``LIFRefracParameters``; with
    ``field``, ``m.p``'s other field: ``"lif_adex"`` of ``LIFAdExRefracParameters``), read
    at each call."""
    from norse.torch.functional.threshold import threshold

    def spike(u: Tensor) -> Tensor:
        q = getattr(m.p, field)
        return threshold(u, q.method, q.alpha)

    def written() -> Any:
        q = getattr(m.p, field)
        return written_norse_grad(q.method, q.alpha)

    spike.written_grad = written  # type: ignore[attr-defined]
    return spike


#: a feed-forward step a kernel reproduces: `NorseKernel`'s modes, ``"lsnn"``
#: (`NorseLSNNFeedForwardKernel`), ``"ex"`` and ``"adex"`` (`NorseExKernel`), ``"iaf"``,
#: ``"libox"`` and ``"coba"`` (`simple_kernel`), ``"izhikevich"`` (`NorseIzhikevichKernel`),
#: ``"refrac"`` (`NorseRefracKernel`), ``"adexrefrac"`` (`NorseAdExRefracKernel`)
FeedForwardMode = (
    NorseMode
    | Literal["lsnn", "ex", "adex", "iaf", "libox", "coba", "izhikevich", "refrac", "adexrefrac"]
)
#: the modes of `simple_kernel`
_SIMPLE = ("iaf", "libox", "coba")


def _kernel_key(m: nn.Module) -> tuple[FeedForwardMode, bool, float] | None:
    """``(mode, subtract, dt)`` of the fused kernel that reproduces ``m``'s step as it is
    now, or None where none does."""
    from norse.torch.functional import reset as resets
    from norse.torch.functional.coba_lif import coba_lif_feed_forward_step
    from norse.torch.functional.iaf import iaf_feed_forward_step
    from norse.torch.functional.izhikevich import izhikevich_feed_forward_step
    from norse.torch.functional.leaky_integrator import li_feed_forward_step
    from norse.torch.functional.leaky_integrator_box import li_box_feed_forward_step
    from norse.torch.functional.lif import lif_feed_forward_step
    from norse.torch.functional.lif_adex import lif_adex_feed_forward_step
    from norse.torch.functional.lif_adex_refrac import lif_adex_refrac_feed_forward_step
    from norse.torch.functional.lif_box import lif_box_feed_forward_step
    from norse.torch.functional.lif_ex import lif_ex_feed_forward_step
    from norse.torch.functional.lif_refrac import lif_refrac_feed_forward_step
    from norse.torch.functional.lsnn import lsnn_feed_forward_step

    modes: dict[Any, FeedForwardMode] = {
        lif_feed_forward_step: "lif",
        lif_box_feed_forward_step: "box",
        li_feed_forward_step: "li",
        lsnn_feed_forward_step: "lsnn",
        lif_ex_feed_forward_step: "ex",
        lif_adex_feed_forward_step: "adex",
        iaf_feed_forward_step: "iaf",
        li_box_feed_forward_step: "libox",
        coba_lif_feed_forward_step: "coba",
        izhikevich_feed_forward_step: "izhikevich",
        lif_refrac_feed_forward_step: "refrac",
        lif_adex_refrac_feed_forward_step: "adexrefrac",
    }
    mode = modes.get(getattr(m, "activation", None))
    p = getattr(m, "p", None)
    dt = getattr(m, "dt", None)
    # Norse's own call only: the kernel never runs a forward of a subclass (the check on
    # random data may miss what it does, e.g. a clamp of the membrane)
    own = type(m).forward in (SNNCell.forward, SNN.forward) and "forward" not in vars(m)
    if mode is None or p is None or not isinstance(dt, float) or not own:
        return None
    if mode in ("refrac", "adexrefrac"):  # the spike's method is p.lif's (p.lif_adex's)
        p = getattr(p, "lif" if mode == "refrac" else "lif_adex", None)
    subtract = False
    if mode == "box":
        reset = getattr(p, "reset_method", None)
        if reset not in (resets.reset_value, resets.reset_subtract):
            return None
        subtract = reset is resets.reset_subtract
    if mode not in ("li", "libox") and getattr(p, "method", None) not in _METHODS:
        return None
    return mode, subtract, dt


class _NorseChunkKernel(NorseKernel):
    """`NorseKernel` for one module, declining each chunk where the module no longer has the
    step it was built for (``dt``, ``reset_method``, ``method``, ``activation`` or
    ``forward`` changed since: the block then runs per step, exactly)."""

    def __init__(self, m: nn.Module, key: tuple[NorseMode, bool, float]) -> None:
        mode, subtract, dt = key
        spike = None if mode == "li" else _norse_spike(m)
        super().__init__(lambda: m.p, dt, spike, mode, subtract=subtract)
        self.module = m
        self.key = key

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        return _kernel_key(self.module) == self.key and super().accepts(leaves, z)


def norse_kernel(m: nn.Module) -> FeedForwardKernel | None:
    """The chunk kernel of the Norse cell or sequence module ``m`` (see
    `NorseAdapter.chunk_kernel`), or None."""
    key = _kernel_key(m)
    if key is None:
        return None
    mode, subtract, dt = key
    if mode == "lsnn":
        return NorseLSNNFeedForwardKernel(
            lambda: m.p, dt, _norse_spike(m), lambda: _kernel_key(m) == key
        )
    if mode == "ex" or mode == "adex":
        return NorseExKernel(
            lambda: m.p, dt, _norse_spike(m), mode == "adex", lambda: _kernel_key(m) == key
        )
    if mode in _SIMPLE:
        return simple_kernel(mode, lambda: m.p, dt, _norse_spike(m), lambda: _kernel_key(m) == key)
    if mode == "izhikevich":
        return NorseIzhikevichKernel(
            lambda: m.p, dt, _norse_spike(m), lambda: _kernel_key(m) == key
        )
    if mode == "refrac":
        return NorseRefracKernel(
            lambda: m.p, dt, _norse_lif_spike(m), lambda: _kernel_key(m) == key
        )
    if mode == "adexrefrac":
        return NorseAdExRefracKernel(
            lambda: m.p, dt, _norse_lif_spike(m, "lif_adex"), lambda: _kernel_key(m) == key
        )
    assert mode in ("lif", "box", "li")  # the modes left: `NorseKernel`'s
    return _NorseChunkKernel(m, (mode, subtract, dt))


def _recurrent_key(m: nn.Module) -> tuple[float, str, str] | None:
    """``(dt, method, step)`` of a ``LIFRecurrentCell`` (step ``"lif"``),
    ``LSNNRecurrentCell`` (``"lsnn"``), ``LIFExRecurrentCell`` (``"ex"``),
    ``LIFAdExRecurrentCell`` (``"adex"``), ``LIFRefracRecurrentCell`` (``"refrac"``) or
    ``LIFAdExRefracRecurrentCell`` (``"adexrefrac"``) whose step a kernel reproduces as it is
    now (Norse's own call, ``lif_step`` / ``lsnn_step`` / ``lif_ex_step`` / ``lif_adex_step`` /
    ``lif_refrac_step`` / ``lif_adex_refrac_step``, a spike method it knows: ``p.method``,
    ``p.lif.method`` or ``p.lif_adex.method``), or None."""
    from norse.torch.functional.lif import lif_step
    from norse.torch.functional.lif_adex import lif_adex_step
    from norse.torch.functional.lif_adex_refrac import lif_adex_refrac_step
    from norse.torch.functional.lif_ex import lif_ex_step
    from norse.torch.functional.lif_refrac import lif_refrac_step
    from norse.torch.functional.lsnn import lsnn_step

    steps = {
        lif_step: "lif",
        lsnn_step: "lsnn",
        lif_ex_step: "ex",
        lif_adex_step: "adex",
        lif_refrac_step: "refrac",
        lif_adex_refrac_step: "adexrefrac",
    }
    p, dt = getattr(m, "p", None), getattr(m, "dt", None)
    own = type(m).forward in (SNNRecurrentCell.forward, SNNRecurrent.forward)
    own = own and "forward" not in vars(m)
    step = steps.get(getattr(m, "activation", None))
    if step is None or not own or not isinstance(dt, float):
        return None
    inner = {"refrac": "lif", "adexrefrac": "lif_adex"}.get(step)
    method = getattr(getattr(p, inner, None) if inner else p, "method", None)
    return (dt, method, step) if method in _METHODS else None


def norse_recurrent_kernel(
    m: nn.Module,
) -> (
    NorseRecurrentKernel
    | NorseLSNNKernel
    | NorseExRecurrentKernel
    | NorseRefracRecurrentKernel
    | None
):
    """The chunk kernel of the ``LIFRecurrentCell``, ``LSNNRecurrentCell``,
    ``LIFExRecurrentCell``, ``LIFAdExRecurrentCell``, ``LIFRefracRecurrentCell`` or
    ``LIFAdExRefracRecurrentCell`` ``m``, or None."""
    key = _recurrent_key(m)
    if key is None:
        return None

    cell: Any = m  # Norse's cell: untyped attributes

    def tensors() -> tuple[Any, Tensor, Tensor]:
        return cell.p, cell.input_weights, cell.recurrent_weights

    def usable() -> bool:
        return _recurrent_key(m) == key and no_hooks(m)

    if key[2] in ("ex", "adex"):
        return NorseExRecurrentKernel(tensors, key[0], _norse_spike(m), key[2] == "adex", usable)
    if key[2] in ("refrac", "adexrefrac"):
        adaptive = key[2] == "adexrefrac"
        spike = _norse_lif_spike(m, "lif_adex" if adaptive else "lif")
        return NorseRefracRecurrentKernel(tensors, key[0], spike, adaptive, usable)
    kernel = NorseLSNNKernel if key[2] == "lsnn" else NorseRecurrentKernel
    return kernel(tensors, key[0], _norse_spike(m), usable)


def sequence_dropouts(module: nn.Module) -> str | None:
    """A warning for a model called on the whole sequence (an ``nn.Sequential`` /
    ``SequentialState``, itself or nested as Norse's ``vgg`` and ``mobilenet``, holding a
    sequence module or a ``Lift``) with Dropout at two or more positions; None otherwise.

    Its own call ``model(x)`` draws the first Dropout's masks for every step, then the next
    one's; the wrapped model runs step by step, each step drawing at every position in turn:
    other masks than ``model(x)`` under the same seed (gradients exact for the masks drawn).
    One Dropout draws the same masks either way."""
    whole = any(
        isinstance(m, nn.Sequential) and any(isinstance(c, (*_SEQUENCE, Lift)) for c in m)
        for m in module.modules()
    )
    drops = [
        name or "<root>"
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    if not whole or len(drops) < 2:
        return None
    return (
        f"spikeckpt: Dropout at {len(drops)} positions ({', '.join(drops[:4])}) of a model "
        "called on the whole sequence (Lift / LIF layers): model(x) draws each Dropout's "
        "masks for every step before the next layer's, the wrapped model steps over time "
        "and draws them step by step, so in training mode it uses other masks than model(x) "
        "under the same seed (its gradients are exact for the masks it draws). To compare "
        "with model(x), set p=0 or call model.eval(); to get the same masks, keep Dropout at "
        "one position"
    )
