"""Fast steps of snnTorch's step neurons: their ``forward``'s tensor ops without its bookkeeping.

snnTorch 1.0.0's ``forward`` of ``Leaky``, ``Synaptic``, ``RLeaky``, ``RSynaptic``,
``Lapicque`` and ``Alpha`` spends most of a small call on module bookkeeping (it stores every
state field and ``reset`` as buffers at each call, which the adapter then clears) rather than
on its tensor ops. A fast step runs those ops, in ``forward``'s order, on the module's own
tensors: ``reset = spike_grad(mem - threshold).detach()``, the class's state function
(``_base_sub`` / ``_base_zero`` / ``_base_int``, including what it computes twice), then
``spike_grad(mem - threshold) * graded_spikes_factor`` (the product skipped for a 0-d factor of
1 without grad: the same values, one autograd node fewer). It never calls the module's
``forward``, so ``torch.compile`` of a step traces no snnTorch bookkeeping (``if not syn ==
None:`` broke dynamo's graph on torch 2.11).

A fast step exists only for exactly those classes with the library's own ``forward`` and state
function, snnTorch's default ``reset_delay=True``, no ``state_quant`` and no ``inhibition``;
`same_results` checks it once against the module's own call before it is used.

This module imports snnTorch; import it only when a snnTorch layer was found.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

import snntorch as snn
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spikeckpt.adapters.kernels import is_unit
from spikeckpt.adapters.protocol import State, no_hooks
from spikeckpt.engine.grad import tensor_hooks_held

__all__ = ["Step", "fast_step", "same_results"]

Step = Callable[[State, Tensor], tuple[State, Tensor]]
Build = Callable[[Any, type, str], Step]

#: the state functions a fast step reproduces, by name
_KINDS = ("_base_sub", "_base_zero", "_base_int")
#: methods ``forward`` goes through: one set on the instance is a model of yours
_METHODS = (
    "_base_state_function",
    "_base_state_reset_zero",
    "_base_state_reset_sub_function",
    "mem_reset",
    "fire",
)


def _one_to_one_classes() -> tuple[type, ...]:
    """snnTorch's ``RecurrentOneToOne`` classes (one in ``rleaky``, one in ``rsynaptic``)."""
    found = []
    for name in ("snntorch._neurons.rleaky", "snntorch._neurons.rsynaptic"):
        try:
            cls = getattr(importlib.import_module(name), "RecurrentOneToOne", None)
        except ImportError:  # pragma: no cover - another snnTorch layout
            cls = None
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


_ONE_TO_ONE = _one_to_one_classes()


def fast_step(m: Any, state_cls: type) -> Step | None:
    """The fast step of the snnTorch neuron ``m`` (its state a ``state_cls``), or None when
    ``m`` is not exactly one of the classes above with the library's own ``forward`` and
    state function, ``reset_delay=True``, no ``state_quant`` and no ``inhibition``."""
    cls = type(m)
    build = _BUILDERS.get(cls)
    if build is None or "forward" in vars(m):
        return None
    bound = getattr(m, "state_function", None)
    function = getattr(bound, "__func__", None)
    kinds = {getattr(cls, name, None): name for name in _KINDS}
    if (
        function not in kinds
        or getattr(bound, "__self__", None) is not m  # another neuron's state function
        or any(name in vars(m) for name in _METHODS)
        or getattr(m, "state_quant", True)
        or getattr(m, "inhibition", True)
        or not getattr(m, "reset_delay", True)  # Lapicque and Alpha have none: delayed
    ):
        return None
    return build(m, state_cls, kinds[function])


def _fit(state: State, x: Tensor) -> list[Tensor]:
    """snnTorch's rule: a state field of another shape than ``x`` (an empty one) is zeros."""
    return [s if s.shape == x.shape else torch.zeros_like(x, device=s.device) for s in state]


def _fire(m: Any, mem: Tensor, spike: Callable[[Tensor], Tensor], threshold: Tensor) -> Tensor:
    """``SpikingNeuron.fire`` without ``state_quant``: the spikes ``(B, ...)``."""
    spk = spike(mem - threshold)
    graded = m.graded_spikes_factor
    # compiled, is_unit says no: the factor is applied (times 1.0: the same values and
    # gradients) rather than read, which would break the compiled graph
    return spk if is_unit(graded) else spk * graded


def _recurrent(m: Any, spk: Tensor) -> Tensor:
    """``m.recurrent(spk)``: torch's ``Linear`` as ``F.linear`` (what its ``forward`` runs)
    and snnTorch's one-to-one map as ``spk * V`` when no hook is on them, else the call."""
    rec = m.recurrent
    kind = type(rec)
    if kind is nn.Linear and no_hooks(rec):
        return F.linear(spk, rec.weight, rec.bias)
    if kind in _ONE_TO_ONE and "forward" not in vars(rec) and no_hooks(rec):
        return spk * rec.V
    return rec(spk)


def _leaky(m: Any, state_cls: type, kind: str) -> Step:
    """``Leaky.forward`` (``mem``)."""

    def step(state: Any, x: Tensor) -> tuple[Any, Tensor]:
        beta, threshold, spike = m.beta, m.threshold, m.spike_grad
        (mem,) = _fit(state, x)
        reset = spike(mem - threshold).detach()
        if kind == "_base_sub":
            mem = beta.clamp(0, 1) * mem + x - reset * threshold
        elif kind == "_base_zero":
            mem = (1 - reset) * mem
            mem = beta.clamp(0, 1) * mem + x
        else:
            mem = beta.clamp(0, 1) * mem + x
        return state_cls(mem), _fire(m, mem, spike, threshold)

    return step


def _synaptic(m: Any, state_cls: type, kind: str) -> Step:
    """``Synaptic.forward`` (``syn, mem``)."""

    def base(syn: Tensor, mem: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        syn = m.alpha.clamp(0, 1) * syn + x
        return syn, m.beta.clamp(0, 1) * mem + syn

    def step(state: Any, x: Tensor) -> tuple[Any, Tensor]:
        threshold, spike = m.threshold, m.spike_grad
        syn0, mem0 = _fit(state, x)
        reset = spike(mem0 - threshold).detach()
        syn, mem = base(syn0, mem0, x)
        if kind == "_base_sub":
            mem = mem - reset * threshold
        elif kind == "_base_zero":
            mem2 = base(syn0, mem0, x)[1]
            syn -= 0 * reset
            mem -= mem2 * reset
        return state_cls(syn, mem), _fire(m, mem, spike, threshold)

    return step


def _rleaky(m: Any, state_cls: type, kind: str) -> Step:
    """``RLeaky.forward`` (``spk, mem``; ``spk`` fed back through ``m.recurrent``)."""

    def base(spk: Tensor, mem: Tensor, x: Tensor) -> Tensor:
        return m.beta.clamp(0, 1) * mem + x + _recurrent(m, spk)

    def step(state: Any, x: Tensor) -> tuple[Any, Tensor]:
        threshold, spike = m.threshold, m.spike_grad
        spk, mem0 = _fit(state, x)
        reset = spike(mem0 - threshold).detach()
        if kind == "_base_sub":
            mem = base(spk, mem0, x) - reset * threshold
        elif kind == "_base_zero":
            mem = base(spk, mem0, x) - reset * base(spk, mem0, x)
        else:
            mem = base(spk, mem0, x)
        spk = _fire(m, mem, spike, threshold)
        return state_cls(spk, mem), spk

    return step


def _rsynaptic(m: Any, state_cls: type, kind: str) -> Step:
    """``RSynaptic.forward`` (``spk, syn, mem``)."""

    def base(spk: Tensor, syn: Tensor, mem: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        syn = m.alpha.clamp(0, 1) * syn + x + _recurrent(m, spk)
        return syn, m.beta.clamp(0, 1) * mem + syn

    def step(state: Any, x: Tensor) -> tuple[Any, Tensor]:
        threshold, spike = m.threshold, m.spike_grad
        spk0, syn0, mem0 = _fit(state, x)
        reset = spike(mem0 - threshold).detach()
        syn, mem = base(spk0, syn0, mem0, x)
        if kind == "_base_sub":
            mem -= reset * threshold
        elif kind == "_base_zero":
            mem2 = base(spk0, syn0, mem0, x)[1]
            syn2 = 0 * reset
            mem2 *= reset
            syn -= syn2
            mem -= mem2
        spk = _fire(m, mem, spike, threshold)
        return state_cls(spk, syn, mem), spk

    return step


def _lapicque(m: Any, state_cls: type, kind: str) -> Step:
    """``Lapicque.forward`` (``mem``; decay from ``R``, ``C`` and ``time_step``)."""

    def base(mem: Tensor, x: Tensor) -> Tensor:
        R, C, dt = m.R, m.C, m.time_step
        return x * R * (1 / (R * C)) * dt + (1 - (dt / (R * C))) * mem

    def step(state: Any, x: Tensor) -> tuple[Any, Tensor]:
        threshold, spike = m.threshold, m.spike_grad
        (mem0,) = _fit(state, x)
        reset = spike(mem0 - threshold).detach()
        if kind == "_base_sub":
            mem = base(mem0, x) - reset * threshold
        elif kind == "_base_zero":
            mem = base(mem0, x) - reset * base(mem0, x)
        else:
            mem = base(mem0, x)
        return state_cls(mem), _fire(m, mem, spike, threshold)

    return step


def _alpha(m: Any, state_cls: type, kind: str) -> Step:
    """``Alpha.forward`` (``syn_exc, syn_inh, mem``)."""

    def base(exc: Tensor, inh: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        alpha, beta = m.alpha, m.beta
        exc = alpha.clamp(0, 1) * exc + x
        inh = beta.clamp(0, 1) * inh - x
        tau = (
            torch.log(alpha.clamp(0, 1))
            / (torch.log(beta.clamp(0, 1)) - torch.log(alpha.clamp(0, 1)))
            + 1
        )
        return exc, inh, tau * (exc + inh)

    def step(state: Any, x: Tensor) -> tuple[Any, Tensor]:
        threshold, spike = m.threshold, m.spike_grad
        exc0, inh0, mem0 = _fit(state, x)
        reset = spike(mem0 - threshold).detach()
        exc, inh, mem = base(exc0, inh0, x)
        if kind != "_base_int":
            if kind == "_base_sub":  # _base_state_reset_sub_function
                exc2, inh2, mem2 = threshold, m.beta.clamp(0, 1) * inh0 - x, -inh0
            else:
                exc2, inh2, mem2 = base(exc0, inh0, x)
            exc -= exc2 * reset
            inh -= inh2 * reset
            mem -= mem2 * reset
        return state_cls(exc, inh, mem), _fire(m, mem, spike, threshold)

    return step


_BUILDERS: dict[type, Build] = {
    snn.Leaky: _leaky,
    snn.Synaptic: _synaptic,
    snn.RLeaky: _rleaky,
    snn.RSynaptic: _rsynaptic,
    snn.Lapicque: _lapicque,
    snn.Alpha: _alpha,
}

#: the tensors a sample input must broadcast with
_SHAPED = ("beta", "threshold", "graded_spikes_factor", "alpha", "V", "R", "C", "time_step")


def _sample_shape(m: Any) -> tuple[int, ...]:
    """A sample shape without the batch that every per-neuron tensor of ``m`` broadcasts
    with and its recurrent map takes (``(5,)`` for scalars)."""
    shapes = [t.shape for t in (getattr(m, n, None) for n in _SHAPED) if isinstance(t, Tensor)]
    rec = getattr(m, "recurrent", None)
    if isinstance(rec, nn.Linear):
        return tuple(torch.broadcast_shapes(*shapes, (rec.in_features,)))
    if isinstance(rec, nn.Conv2d):
        return tuple(torch.broadcast_shapes(*shapes, (rec.in_channels, 4, 4)))
    shape = tuple(torch.broadcast_shapes(*shapes))
    return shape if shape and shape[-1] > 1 else (*shape[:-1], 5)


class Checked(Protocol):
    """What `same_results` needs of the adapter."""

    module: nn.Module
    state_cls: type

    def cleanup(self) -> None: ...


def same_results(slow: Step, fast: Step, adapter: Checked) -> bool:
    """Both steps on random data from a random state (every field): outputs, new state and
    the gradients of a weighted sum of both with respect to input, state and parameters,
    bitwise."""
    m = adapter.module
    fields: tuple[str, ...] = adapter.state_cls._fields  # type: ignore[attr-defined]
    try:
        floats = [t for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()]
        like = floats[0] if floats else torch.zeros(())
        params = [p for p in m.parameters() if p.requires_grad]
        results = []
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            for step in (slow, fast):
                torch.manual_seed(0)  # the same data for both (and the same SSO draws)
                shape = (3, *_sample_shape(m))
                x, *state = [
                    (torch.randn(shape) * 2).to(like).requires_grad_()
                    for _ in range(1 + len(fields))
                ]
                new, y = step(adapter.state_cls(*state), x)
                outs = [y, *new]
                # e.g. surrogate_disable=True: spikes without grad (which the slow step's match)
                tracked = [o for o in outs if o.requires_grad]
                weights = [torch.linspace(-1, 1, o.numel()).to(o).reshape(o.shape) for o in tracked]
                with tensor_hooks_held(params):  # a check's gradients, not yours
                    grads = torch.autograd.grad(
                        tracked, [x, *state, *params], weights, allow_unused=True
                    )
                flags = torch.tensor([o.requires_grad for o in outs])
                results.append([*(o.detach() for o in outs), flags, *grads])
                adapter.cleanup()
    except Exception:  # noqa: BLE001 - anything unexpected: keep the module's own call
        return False
    return all(_same(a, b) for a, b in zip(*results, strict=True))


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    """Both None (no gradient) or equal tensors."""
    return a is b is None or (a is not None and b is not None and torch.equal(a, b))
