"""Chunk kernels: the LIF family's recurrence over a time chunk, forward and backward by hand.

Each kernel implements `ChunkKernel` for one family of neuron
steps, in plain tensor ops with the framework's own arithmetic (the same operations on the same
operands in the same order as the framework's step, so states and spikes are bitwise equal);
its backward runs the state gradient back through the chunk with the derivatives written out,
and takes the surrogate gradient from the framework's own surrogate function, evaluated once
for the whole chunk (it is elementwise). Gradients agree with autograd through the plain loop
to float32 round-off: the state gradient's sums run in autograd's order where two terms meet
(bitwise there), parameter gradients are summed over the whole chunk at once.

The kernels import no framework: the adapters (`spikeckpt.adapters.snntorch`,
`spikeckpt.adapters.norse`) read the modules' parameters and pick the kernel and options,
and check a kernel against the module's own step once before using it
(`spikeckpt.adapters.layered.VerifiedKernel`).

Notation (per element, step ``t`` of the chunk): ``z_t`` synaptic input, ``r_t`` the reset
(spike of the membrane entering the step, no gradient), ``u_t`` the membrane less the
threshold, ``s_t = H(u_t)`` the spike, ``y_t = s_t * graded``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import torch
from torch import Tensor

from spikeckpt.adapters.host_loops import (
    leaky_backward_on_host,
    leaky_forward_on_host,
    norse_backward_lean_on_host,
    norse_backward_on_host,
    norse_forward_on_host,
    synaptic_backward_on_host,
    synaptic_forward_on_host,
)
from spikeckpt.adapters.memo import TensorMemo
from spikeckpt.engine.compiled import is_compiling
from spikeckpt.engine.fused import Emit, Emitted, EmittedGrad
from spikeckpt.engine.grad import grad as engine_grad
from spikeckpt.engine.meter import unmetered
from spikeckpt.errors import ConfigError

__all__ = [
    "LeakyKernel",
    "SurrogateKernel",
    "NorseKernel",
    "SynapticKernel",
    "as_spikes",
    "clamp_grad",
    "emitted",
    "heaviside",
    "is_unit",
    "norse_heaviside",
    "per_leaf",
    "read_unit_again",
    "reduce_to",
    "scales",
    "scaling",
    "vjp",
]

Spike = Callable[[Tensor], Tensor]
#: ``(u, grad) -> dL/du``: a surrogate's backward at ``u`` for the spike's gradient ``grad``
#: (``u`` is a new tensor the function may overwrite and return)
SpikeGrad = Callable[[Tensor, Tensor], Tensor]


def scaling(grad: SpikeGrad) -> SpikeGrad:
    """Mark ``grad`` as a slope times the incoming gradient, ``grad(u, g) == grad(u, 1) * g``
    bitwise (snnTorch's ``atan``): a recurrence may take the slope once per chunk."""
    grad.scales = True  # type: ignore[attr-defined]
    return grad


def scales(grad: SpikeGrad | None) -> bool:
    """Whether ``grad`` is marked by `scaling`."""
    return bool(getattr(grad, "scales", False))


#: ``"subtract"``: ``m - r * thr``; ``"zero_before"``: ``(1 - r) * m`` before the decay
#: (snnTorch ``Leaky``); ``"zero_after"``: ``m - r * m`` after it (``Lapicque``,
#: ``Synaptic``); ``"none"``.
Reset = Literal["subtract", "zero_before", "zero_after", "none"]


#: a boolean tensor of at least this many elements is cast through ``uint8`` (`as_spikes`)
CAST_VIA_BYTES = 2048


def as_spikes(fired: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``fired.to(dtype)``: the same 0 / 1 values, cast through a ``uint8`` view where
    ``fired`` is a boolean tensor of at least `CAST_VIA_BYTES` elements (torch's CPU cast
    from bool took 5-10x the cast from uint8: 118 against 16 us for 25 x 16 x 512 to
    float32; below 2,048 elements the extra view costs more than it saves)."""
    if fired.dtype == torch.bool and fired.numel() >= CAST_VIA_BYTES and not is_compiling():
        return fired.view(torch.uint8).to(dtype)
    return fired.to(dtype)


def norse_heaviside(u: Tensor) -> Tensor:
    """Norse's ``heaviside``: ``gt(u, 0)`` as ``u``'s dtype."""
    return as_spikes(torch.gt(u, torch.as_tensor(0.0)), u.dtype)


def heaviside(u: Tensor) -> Tensor:
    """snnTorch's spike: ``(u > 0).float()`` (float32 whatever ``u`` is)."""
    return as_spikes(u > 0)


def vjp(fn: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor) -> Tensor:
    """``grad`` through the elementwise ``fn`` at ``x`` (autograd's own formula, one call for
    a whole chunk); zeros when ``fn``'s output has no gradient (snnTorch's
    ``surrogate_disable``)."""
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        out = fn(leaf)
        if not out.requires_grad:
            return torch.zeros_like(grad)
        (got,) = engine_grad([out], [leaf], [grad])
    return torch.zeros_like(grad) if got is None else got


def reduce_to(grad: Tensor, like: Tensor) -> Tensor:
    """``grad`` summed over the dimensions ``like`` was broadcast along, in ``like``'s shape."""
    if grad.shape == like.shape:
        return grad
    lead = grad.dim() - like.dim()
    dims = [*range(lead), *(lead + i for i, n in enumerate(like.shape) if n == 1)]
    out = grad.sum(dim=dims, keepdim=True) if dims else grad
    return out.reshape(like.shape)


@functools.cache
def _clamp_bound_grads() -> tuple[float, float]:
    """Torch's own gradient of ``v.clamp(0, 1)`` at ``v = 0`` and ``v = 1`` (scalar bounds, as
    snnTorch clamps ``beta`` and ``alpha``): 0 at both in torch 2.14, which once passed it."""
    v = torch.tensor([0.0, 1.0], requires_grad=True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(v.clamp(0, 1).sum(), v)
    return float(g[0]), float(g[1])


def clamp_grad(grad: Tensor, value: Tensor) -> Tensor:
    """The gradient of ``value.clamp(0, 1)`` given ``grad`` for its result, as torch's autograd
    gives it, at the bounds too (a learnable ``beta`` of exactly 1.0 or 0.0)."""
    low, high = _clamp_bound_grads()
    scale = ((value > 0) & (value < 1)).to(grad.dtype)
    if low:
        scale = scale + (value == 0).to(grad.dtype) * low
    if high:
        scale = scale + (value == 1).to(grad.dtype) * high
    return grad * scale


def field_fits(t: object, like: Tensor, learnable: bool = False) -> bool:
    """Whether ``t`` is a field of a Norse parameter NamedTuple that a kernel computes with as
    Norse does on ``like``'s device and dtype: a Python number; a tensor on ``like``'s device
    (or a 0-d CPU scalar) of ``like``'s dtype, or 0-d of a real dtype (it does not widen a
    step: ``LIFAdExParameters``' ``adaptation_current`` is an int64 4). One that takes a
    gradient only where ``learnable`` (the kernel returns its gradient), and then floating."""
    if isinstance(t, (int, float)):
        return True
    if not isinstance(t, Tensor) or (t.requires_grad and not learnable):
        return False
    if not (t.device == like.device or (t.dim() == 0 and t.device.type == "cpu")):
        return False
    if t.requires_grad and not t.is_floating_point():
        return False
    return t.dtype == like.dtype or (t.dim() == 0 and not t.is_complex())


def _is_number(t: object) -> bool:
    """A Python ``int`` or ``float`` (not ``bool``), which Norse's steps take as a field."""
    return isinstance(t, (int, float)) and not isinstance(t, bool)


def _host_scalar(t: Tensor) -> bool:
    """A 0-d CPU tensor that needs no gradient: torch takes it as a scalar beside tensors on
    any device (Norse's parameters stay on the CPU when a model moves to a GPU)."""
    return t.dim() == 0 and t.device.type == "cpu" and not t.requires_grad


def _same_layout(leaves: Sequence[Tensor], z: Tensor, frozen: Sequence[Tensor] = ()) -> bool:
    """Every state leaf is shaped like one step of ``z``, on its device, float32 or float64
    (the dtype the step keeps: a spike is float32, so a lower-precision state is promoted by
    the first step, which then runs unfused); ``frozen`` tensors need no gradient."""
    step = z.shape[1:]
    return (
        z.is_floating_point()
        and all(
            t.shape == step and t.dtype in (torch.float32, torch.float64) and t.device == z.device
            for t in leaves
        )
        and not any(t.requires_grad for t in frozen)
    )


_NEAR_SMALLEST_NORMAL = (torch.tensor([1.5e-38]), torch.tensor([1.4e-38]))


def _subtraction_is_exact(device: torch.device) -> bool:
    """Whether ``a - b > 0`` is ``a > b`` for every pair of floats here: true under IEEE
    arithmetic with subnormals (a difference of distinct floats is never rounded to zero),
    false while the CPU flushes subnormal results to zero (``torch.set_flush_denormal``),
    checked on a pair whose difference is subnormal. CUDA kernels keep subnormals."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    a, b = _NEAR_SMALLEST_NORMAL
    return bool((a - b) > 0)


def _keeps_dtype(kernel: Any, leaves: Sequence[Tensor], z: Tensor) -> bool:
    """Whether one step keeps the state's dtypes (a parameter of a wider dtype would widen
    it): tried once per combination of dtypes and dimensions, on one sample of one step."""
    tensors = (*leaves, z, *kernel.params, *getattr(kernel, "frozen", tuple)())
    key = tuple((t.dtype, t.dim()) for t in tensors)
    known = kernel.dtype_checks.get(key)
    if known is None:
        with torch.no_grad(), unmetered():  # once per dtypes: not part of any step
            one = [t[:1] for t in leaves]  # one sample: every broadcast stays as it is
            final = kernel.forward(one, z[:1, :1], False, False)[0]
        known = all(a.dtype == b.dtype for a, b in zip(final, leaves, strict=True))
        kernel.dtype_checks[key] = known
    return known


def _grads_for(
    pairs: Sequence[tuple[Tensor, Callable[[], Tensor | None]]], need: Sequence[bool]
) -> list[Tensor | None]:
    """Gradients of the parameters that require grad (``need`` is aligned with those); None
    where ``make`` gives None (a parameter the step does not use)."""
    wanted = [(p, make) for p, make in pairs if isinstance(p, Tensor) and p.requires_grad]
    made = [make() if n else None for (_, make), n in zip(wanted, need, strict=True)]
    return [None if g is None else reduce_to(g, p) for (p, _), g in zip(wanted, made, strict=True)]


class LeakyKernel:
    """snnTorch ``Leaky`` / ``Lapicque`` (``reset_delay=True``): one membrane.

    ``mem_t = decay * pre + zin_t``, then the reset; ``pre = (1 - r) * mem`` with
    ``"zero_before"``, else ``mem``. ``zin = input_scale(z)`` (``Leaky``: ``z`` itself;
    ``Lapicque``: ``z * R * (1 / (R * C)) * time_step``), applied to the whole chunk at once.

    Args:
        tensors: ``() -> (decay source, threshold, graded)``: the module's current tensors;
            the decay is ``decay_of(source)``.
        decay_of: ``source -> decay`` (``Leaky``: ``beta.clamp(0, 1)``).
        decay_grad: ``(grad of decay, source) -> grad of source``, or None when the source
            never needs one.
        spike: the surrogate spike function (its forward must be `heaviside`).
        reset: the reset mechanism.
        input_scale: ``z (k, B, ...) -> zin``, elementwise (None: the identity).
        frozen: ``() -> tensors`` the step also reads, which must not require grad (the chunk
            runs unfused when one does).
        spike_grad: ``(u, grad) -> dL/du``, the surrogate's backward written out (in place,
            one buffer), when the adapter knows it; else the surrogate's own backward runs.
    """

    name = "fused"
    membrane: int | None = 0
    emits_states = False
    binary_leaves: tuple[int, ...] = ()

    @property
    def binary_output(self) -> bool:
        """Whether the spikes are 0 or 1: the graded factor a fixed 1."""
        return is_unit(self.tensors()[2])

    def __init__(
        self,
        tensors: Callable[[], tuple[Tensor, Tensor, Tensor]],
        decay_of: Callable[[Tensor], Tensor],
        decay_grad: Callable[[Tensor, Tensor], Tensor] | None,
        spike: Spike,
        reset: Reset,
        input_scale: Callable[[Tensor], Tensor] | None = None,
        frozen: Callable[[], tuple[Tensor, ...]] = tuple,
        spike_grad: SpikeGrad | None = None,
    ) -> None:
        self.tensors = tensors
        self.spike_grad = spike_grad
        self.decay_of = decay_of
        self.decay_grad = decay_grad
        self.spike = spike
        self.reset = reset
        self.input_scale = input_scale
        self.frozen = frozen
        self.dtype_checks: dict[tuple[Any, ...], bool] = {}

    @property
    def params(self) -> tuple[Tensor, ...]:
        return self.tensors()

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        source = self.tensors()[0]
        frozen = (*self.frozen(), *((source,) if self.decay_grad is None else ()))
        return (
            len(leaves) == 1 and _same_layout(leaves, z, frozen) and _keeps_dtype(self, leaves, z)
        )

    def forward(
        self,
        leaves: list[Tensor],
        z: Tensor,
        keep: bool,
        want_mem: bool,
        want_y: bool = True,
        into: Tensor | None = None,
        emit: Emit = None,
    ) -> tuple[list[Tensor], Tensor | None, Emitted, Any]:
        source, thr, graded = self.tensors()
        decay = self.decay_of(source)
        zin = z if self.input_scale is None else self.input_scale(z)
        mem = leaves[0]
        k = zin.shape[0]
        # states and spikes go straight into their (k + 1)-step buffers (out=: the same
        # kernels, so the same values); the spike is snnTorch's (mem - thr > 0).float(), and a
        # reset ``r * v`` is ``v`` or ``0 * v``: a where() on the boolean spike. Each step
        # reads its input before it writes its membrane, so the membranes may go over the
        # input's own buffer (``into``, whose rows 1.. are ``z``)
        hold = keep or want_mem
        mems = None
        if hold:
            usable = into is not None and zin is z and into.dtype == mem.dtype
            mems = into if usable else mem.new_empty((k + 1, *mem.shape))
        fires = torch.empty((k + 1, *mem.shape), dtype=torch.bool, device=mem.device)
        if mems is not None:
            mems[0] = mem
        # then (mem - thr > 0) == (mem > thr); compiled: snnTorch's own form (no host read)
        exact = not is_compiling() and _subtraction_is_exact(mem.device)
        torch.gt(mem - thr, 0, out=fires[0])
        thr_off = thr * 0
        last = None
        if exact:
            last = leaky_forward_on_host(mem, zin, decay, thr, self.reset, mems, fires)
        if last is not None:
            mem = last
        for t, z_t in enumerate(zin.unbind(0) if last is None else ()):
            fired, out = fires[t], (mems[t + 1] if mems is not None else None)
            pre = torch.where(fired, mem * 0, mem) if self.reset == "zero_before" else mem
            if self.reset == "subtract":
                mem = torch.sub(decay * pre + z_t, torch.where(fired, thr, thr_off), out=out)
            elif self.reset == "zero_after":
                base = decay * pre + z_t
                mem = torch.sub(base, as_spikes(fired) * base, out=out)
            else:
                mem = torch.add(decay * pre, z_t, out=out)
            if exact:
                torch.gt(mem, thr, out=fires[t + 1])
            else:
                torch.gt(mem - thr, 0, out=fires[t + 1])
        y = None
        if want_y:
            s = as_spikes(fires[1:])
            y = s if is_unit(graded) else s * graded
        # z only when an input scale's gradient needs it (a view of the chunk, alive anyway)
        saved = (mems, fires, z if self.input_scale else None) if keep else None
        # want_mem implies hold, so the membranes were kept
        out_mem = cast(Tensor, mems)[1:] if want_mem else None
        return [mem.clone() if mems is not None else mem], y, out_mem, saved

    def backward(
        self,
        saved: Any,
        g_y: Tensor | None,
        g_final: list[Tensor | None],
        g_mem: EmittedGrad,
        need_z: bool,
        need_params: Sequence[bool],
        consume: bool = False,
        emit: Emit = None,
    ) -> tuple[Tensor | None, list[Tensor | None], list[Tensor | None]]:
        mems, fired, z = saved  # (k + 1, B, ...): membranes; spikes (bool), the reset of t
        g_mem = per_leaf(g_mem, emit, 1, 0)[0]  # the membrane's (leaf 0)
        source, thr, graded = self.tensors()
        decay = self.decay_of(source)
        k = mems.shape[0] - 1
        want = _wanted([source, thr, graded], need_params)
        zero = self.reset in ("zero_before", "zero_after")
        thr_grad = graded_grad = None
        # ``consume``: the membranes are read last by the surrogate (no decay gradient), so
        # its ``u = mem - thr`` and then dL/du may go over them
        reuse = consume and not want[0] and self.spike_grad is not None and mems.is_contiguous()
        if g_y is not None:
            g_s = g_y if is_unit(graded) else g_y * graded
            if reuse:
                u = torch.sub(mems[1:], thr, out=mems[1:])
                g = self.spike_grad(u, g_s)  # type: ignore[misc]
            else:
                g = surrogate_grad(self.spike, mems[1:], thr, g_s, self.spike_grad)  # dL/du_t
            if want[1]:
                thr_grad = -reduce_to(g, thr)
            if want[2]:
                graded_grad = reduce_product(g_y, fired[1:], graded)
            del g_s
        else:
            g = torch.zeros_like(mems[1:])
        # g[t] becomes dL/d mem_t (the membrane after step t), every path, from the last step
        if g_mem is not None:
            g += g_mem
        keep_old = (~fired[:-1]).to(g.dtype) if zero else None  # (1 - r_t)
        carry = g_final[0]
        host_carry = leaky_backward_on_host(g, decay, carry, self.reset, fired)
        for t in range(k - 1, -1, -1) if host_carry is None else ():
            if carry is not None:
                g[t] += carry
            g_base = g[t] * keep_old[t] if self.reset == "zero_after" else g[t]  # type: ignore[index]
            carry = decay * g_base
            if self.reset == "zero_before":
                carry = carry * keep_old[t]  # type: ignore[index]
        if host_carry is not None:
            carry = host_carry
        if want[1] and self.reset == "subtract":  # mem_t = base - r_t * thr
            part = reduce_product(g, fired[:-1], thr)
            thr_grad = -part if thr_grad is None else thr_grad - part
        if self.reset == "zero_after":
            g.mul_(cast(Tensor, keep_old))  # dL/d base_t (zero_after: keep_old is set)
        source_grad = None
        if want[0]:
            pre = mems[:-1] * keep_old if self.reset == "zero_before" else mems[:-1]
            assert self.decay_grad is not None  # accepts() refused the chunk otherwise
            source_grad = self.decay_grad(reduce_product(g, pre, decay), source)
            del pre
        g_z = None
        if need_z:
            g_z = g if self.input_scale is None else vjp(self.input_scale, z, g)
        grads = [source_grad, thr_grad if want[1] else None, graded_grad]
        return g_z, [carry], _aligned([source, thr, graded], grads, need_params)


class SurrogateKernel:
    """What the snnTorch kernels with a surrogate share: the module's current tensors, the
    surrogate spike function (and its backward written out, when the adapter knows it), the
    reset mechanism, and the dtype checks of `_keeps_dtype`.

    Args:
        tensors: ``() -> (...)``, the module's current tensors (the kernel's ``params``).
        spike: the surrogate spike function.
        reset: the reset mechanism.
        spike_grad: the surrogate's backward written out, or None (its own, by autograd).
    """

    name = "fused"
    emits_states = False

    @property
    def binary_leaves(self) -> tuple[int, ...]:
        """None of the state's leaves is a spike train (a subclass's may be)."""
        return ()

    def __init__(
        self,
        tensors: Callable[[], tuple[Tensor, ...]],
        spike: Spike,
        reset: Reset,
        spike_grad: SpikeGrad | None = None,
    ) -> None:
        self.tensors = tensors
        self.spike = spike
        self.reset = reset
        self.spike_grad = spike_grad
        self.dtype_checks: dict[tuple[Any, ...], bool] = {}

    @property
    def params(self) -> tuple[Tensor, ...]:
        return self.tensors()

    @property
    def binary_output(self) -> bool:
        """Whether the spikes are 0 or 1: the graded factor (the tensors' last) a fixed 1."""
        return is_unit(self.tensors()[-1])


class ImmediateLeakyKernel(SurrogateKernel):
    """snnTorch ``Leaky`` with ``reset_delay=False``: the reset in the step that fires.

    Per step, as ``Leaky.forward`` does it: ``r = (mem - thr > 0)`` (detached); ``base = b *
    mem + z - r * thr`` (``"subtract"``) or ``b * ((1 - r) * mem) + z`` (``"zero_before"``:
    snnTorch's ``"zero"``); ``spk = heaviside(base - thr) * graded``; ``do = spk / graded - r``;
    ``mem = base - do * thr`` or ``base - do * base``. The immediate reset is differentiated
    through the surrogate, as in snnTorch. ``beta``, the threshold and the graded factor may
    be learnable (the graded factor's gradient through ``do`` cancels: ``spk / graded`` does
    not depend on it, so it is ``sum(g_y * s)`` as for the other kernels).

    Args:
        tensors: ``() -> (beta, threshold, graded)``, the module's current tensors.
        spike: the surrogate spike function (its forward must be `heaviside`).
        reset: ``"subtract"`` or ``"zero_before"``.
        spike_grad: the surrogate's backward written out, when the adapter knows it.
    """

    membrane: int | None = 0

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        return len(leaves) == 1 and _same_layout(leaves, z) and _keeps_dtype(self, leaves, z)

    def forward(
        self,
        leaves: list[Tensor],
        z: Tensor,
        keep: bool,
        want_mem: bool,
        want_y: bool = True,
        into: Tensor | None = None,
        emit: Emit = None,
    ) -> tuple[list[Tensor], Tensor | None, Emitted, Any]:
        beta, thr, graded = self.tensors()
        b = beta.clamp(0, 1)
        mem = leaves[0]
        reset = mem - thr > 0
        mems, bases, fires, resets = [mem], [], [], []
        for z_t in z.unbind(0):
            r = as_spikes(reset, mem.dtype)
            if self.reset == "subtract":
                base = b * mem + z_t - r * thr
            else:
                base = b * ((1 - r) * mem) + z_t
            fired = base - thr > 0
            spk = as_spikes(fired, mem.dtype) * graded
            do = spk / graded - r
            mem = base - do * thr if self.reset == "subtract" else base - do * base
            resets.append(reset)
            reset = mem - thr > 0
            fires.append(fired)
            mems.append(mem)
            if keep:
                bases.append(base)
        all_fired = torch.stack(fires)
        # snnTorch's spike is float32 whatever the membrane (``heaviside``), times the factor
        y = as_spikes(all_fired) * graded if want_y else None
        mem_all = torch.stack(mems) if keep or want_mem else None
        saved = None
        if keep:
            saved = (mem_all, torch.stack(bases), all_fired, torch.stack(resets))
        return [mem], y, mem_all[1:] if want_mem else None, saved  # type: ignore[index]

    def backward(
        self,
        saved: Any,
        g_y: Tensor | None,
        g_final: list[Tensor | None],
        g_mem: EmittedGrad,
        need_z: bool,
        need_params: Sequence[bool],
        consume: bool = False,
        emit: Emit = None,
    ) -> tuple[Tensor | None, list[Tensor | None], list[Tensor | None]]:
        mems, bases, fired, resets = saved
        g_mem = per_leaf(g_mem, emit, 1, 0)[0]  # the membrane's (leaf 0)
        beta, thr, graded = self.tensors()
        b = beta.clamp(0, 1)
        subtract = self.reset == "subtract"
        want = _wanted([beta, thr, graded], need_params)
        k = bases.shape[0]
        g_base = torch.empty_like(bases)
        carry = g_final[0]
        g_thr: Tensor | None = None  # dL/d thr per element, summed over the steps
        for t in range(k - 1, -1, -1):
            g = carry if g_mem is None else (g_mem[t] if carry is None else carry + g_mem[t])
            if g is None:
                g = torch.zeros_like(bases[t])
            r = resets[t].to(g.dtype)
            do = fired[t].to(g.dtype) * graded / graded - r
            g_do = -g * (thr if subtract else bases[t])  # mem = base - do * (thr | base)
            g_spk = g_do / graded if g_y is None else g_y[t] + g_do / graded
            g_u = surrogate_grad(self.spike, bases[t], thr, g_spk * graded, self.spike_grad)
            g_base[t] = (g if subtract else g - g * do) + g_u
            if want[1]:  # spike(base - thr); subtract: base = ... - r * thr, mem = ... - do * thr
                part = g_u + (g_base[t] * r + g * do if subtract else 0)
                g_thr = part if g_thr is None else g_thr + part
            carry = b * g_base[t] if subtract else b * g_base[t] * (1 - r)
        beta_grad = thr_grad = graded_grad = None
        if want[0]:
            pre = mems[:-1] if subtract else mems[:-1] * (~resets).to(mems.dtype)
            beta_grad = clamp_grad(reduce_product(g_base, pre, b), beta)
        if g_thr is not None:
            thr_grad = -reduce_to(g_thr, thr)
        if want[2] and g_y is not None:
            graded_grad = reduce_product(g_y, fired, graded)
        elif want[2]:
            graded_grad = torch.zeros_like(graded)
        grads = [beta_grad, thr_grad, graded_grad]
        return (
            g_base if need_z else None,
            [carry],
            _aligned([beta, thr, graded], grads, need_params),
        )


def _wanted(tensors: Sequence[Tensor], need_params: Sequence[bool]) -> list[bool]:
    """Per tensor: whether its gradient is asked for (``need_params`` lists the tensors that
    require grad, in order)."""
    it = iter(need_params)
    return [bool(next(it)) if t.requires_grad else False for t in tensors]


def _aligned(
    tensors: Sequence[Tensor], grads: Sequence[Tensor | None], need_params: Sequence[bool]
) -> list[Tensor | None]:
    """The gradients of the tensors that require grad, aligned with ``need_params``."""
    out = [g for t, g in zip(tensors, grads, strict=True) if t.requires_grad]
    return [g if n else None for g, n in zip(out, need_params, strict=True)]


def emitted(want_mem: bool, emit: Emit, held: Sequence[Tensor | None], membrane: int) -> Emitted:
    """A forward's per-step output from the states it held, ``(k + 1, B, ...)`` per leaf
    (row 0: before the chunk): the membrane's rows ``1..``, or with ``emit`` those of the
    leaves it numbers (a tuple); None without ``want_mem``."""
    if not want_mem:
        return None
    rows = [held[membrane]] if emit is None else [held[i] for i in emit]
    assert all(t is not None for t in rows)
    if emit is None:
        return rows[0][1:]  # type: ignore[index]
    return tuple(t[1:] for t in rows)  # type: ignore[index]


def per_leaf(g_mem: EmittedGrad, emit: Emit, n: int, membrane: int) -> list[Tensor | None]:
    """A backward's ``g_mem`` as one gradient per state leaf (``n`` leaves, None where it has
    none): all on the membrane, or with ``emit`` on the leaves it numbers."""
    out: list[Tensor | None] = [None] * n
    if emit is None:
        out[membrane] = g_mem  # type: ignore[assignment]
        return out
    for i, g in zip(emit, g_mem, strict=True):  # type: ignore[arg-type]
        if g is not None:
            before = out[i]
            out[i] = g if before is None else before + g
    return out


#: the surrogate's backward and the parameters' gradient products run on pieces of at most
#: this many elements (256 KiB of float32), so their temporaries stay bounded whatever the
#: chunk length
PIECE_ELEMENTS = 1 << 16


def _pieces(t: Tensor) -> list[tuple[int, int]]:
    """``(a, b)`` ranges of ``t``'s first dimension (the chunk's steps): a quarter of the
    chunk each, and at most `PIECE_ELEMENTS` elements (at least one step), so the
    temporaries of a vectorised pass stay a small share of the chunk's own tensors."""
    k = t.shape[0]
    if not k:
        return []
    step = max(1, min(PIECE_ELEMENTS // max(1, t[0].numel()), -(-k // 4)))
    return [(a, min(k, a + step)) for a in range(0, k, step)]


def reduce_product(a: Tensor, b: Tensor, like: Tensor) -> Tensor:
    """``reduce_to(a * b, like)`` (``b`` may be boolean) without the whole product: summed a
    few steps at a time along the first dimension."""
    total: Tensor | None = None
    for lo, hi in _pieces(a):
        part = reduce_to(a[lo:hi] * b[lo:hi].to(a.dtype), like)
        total = part if total is None else total + part
    assert total is not None
    return total


def surrogate_grad(
    spike: Spike,
    mem: Tensor,
    thr: Tensor,
    grad: Tensor | None,
    written: SpikeGrad | None = None,
    overwrite: bool = False,
) -> Tensor:
    """``grad`` (dL/d spike, ``(k, B, ...)``; None: ones, the spike's slope, without a
    tensor of ones where the backward is written out) through ``spike`` at ``mem - thr``:
    the surrogate's backward written out (``written``, or the one ``spike`` carries as
    ``spike.written_grad()``: Norse's), or its own backward by autograd (elementwise) a few
    steps at a time. A new tensor; with ``overwrite`` (``mem`` is the caller's, read for
    the last time) it may be ``mem``, overwritten."""
    find = None
    if written is None:
        find = getattr(spike, "written_grad", None)  # the spike's own (Norse's), read now
        written = find() if find is not None else None
    if written is not None:
        u_dtype = torch.result_type(mem, thr)
        if find is None or u_dtype == (mem.dtype if grad is None else grad.dtype):
            with torch.no_grad():  # as autograd's backward: no graph (a learnable threshold's)
                in_place = overwrite and u_dtype == mem.dtype
                u = torch.sub(mem, thr, out=mem) if in_place else mem - thr
                if grad is None:  # ones, as one value broadcast: the same values, no tensor
                    grad = torch.ones((), dtype=mem.dtype, device=mem.device).expand(u.shape)
                return written(u, grad)
    if grad is None:
        grad = torch.ones_like(mem)
    pieces = _pieces(mem)
    if len(pieces) == 1:
        return vjp(spike, mem - thr, grad)
    out = torch.empty_like(grad, dtype=torch.promote_types(grad.dtype, mem.dtype))
    for a, b in pieces:
        out[a:b] = vjp(spike, mem[a:b] - thr, grad[a:b])
    return out


#: ``is_unit``'s answers, per tensor and version
_UNIT: TensorMemo[bool] = TensorMemo()


def is_unit(graded: Tensor) -> bool:
    """Whether ``s * graded`` is ``s`` bitwise (a 0-d 1.0 without grad); the value is read
    once per tensor and version (no device sync per step). False while ``torch.compile``
    traces (``s * 1.0`` is ``s`` bitwise; the value read would break the graph)."""
    if graded.dim() != 0 or graded.requires_grad or is_compiling():
        return False
    return _UNIT.get(graded, _equals_one)


def read_unit_again(graded: Tensor) -> None:
    """Make `is_unit` read ``graded`` again at its next call (once per forward: a write
    through ``graded.data``, e.g. ``lif.graded_spikes_factor.data.fill_(0.5)``, keeps the
    version counter that `is_unit`'s memo goes by)."""
    _UNIT.forget(graded)


def _equals_one(t: Tensor) -> bool:
    return bool(t == 1)


class SynapticKernel(SurrogateKernel):
    """snnTorch ``Synaptic`` (``reset_delay=True``): synaptic current, then membrane.

    ``syn_t = a * syn + z_t``, ``mem_t = b * mem + syn_t``, then the reset (``"subtract"``,
    ``"zero_after"`` or ``"none"``); ``a = alpha.clamp(0, 1)``, ``b = beta.clamp(0, 1)``.

    Args:
        tensors: ``() -> (alpha, beta, threshold, graded)``, the module's current tensors.
        spike: the surrogate spike function.
        reset: the reset mechanism.
    """

    membrane: int | None = 1
    emits_states = True
    binary_leaves: tuple[int, ...] = ()

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        return len(leaves) == 2 and _same_layout(leaves, z) and _keeps_dtype(self, leaves, z)

    def forward(
        self,
        leaves: list[Tensor],
        z: Tensor,
        keep: bool,
        want_mem: bool,
        want_y: bool = True,
        into: Tensor | None = None,
        emit: Emit = None,
    ) -> tuple[list[Tensor], Tensor | None, Emitted, Any]:
        alpha, beta, thr, graded = self.tensors()
        a, b = alpha.clamp(0, 1), beta.clamp(0, 1)
        syn, mem = leaves
        # then (mem - thr > 0) == (mem > thr); compiled: snnTorch's own form (no host read)
        exact = not is_compiling() and _subtraction_is_exact(mem.device)
        if exact:
            done = self._forward_on_host(
                syn, mem, z, (a, b, thr, graded), keep, (want_mem, want_y, emit)
            )
            if done is not None:
                return done
        fired = mem - thr > 0
        thr_off = thr * 0
        syns, mems, fires = [syn], [mem], [fired]
        for z_t in z.unbind(0):
            syn = a * syn + z_t
            base = b * mem + syn
            if self.reset == "subtract":
                mem = base - torch.where(fired, thr, thr_off)
            elif self.reset == "zero_after":
                mem = base - base * as_spikes(fired)
            else:
                mem = base
            fired = mem > thr if exact else mem - thr > 0
            fires.append(fired)
            if keep or want_mem:
                syns.append(syn)
                mems.append(mem)
        all_fired = torch.stack(fires)
        y = None
        if want_y:
            s = as_spikes(all_fired[1:])
            y = s if is_unit(graded) else s * graded
        mem_all = torch.stack(mems) if keep or want_mem else None
        syn_all = torch.stack(syns) if keep or (want_mem and emit) else None
        saved = (syn_all, mem_all, all_fired) if keep else None
        return [syn, mem], y, emitted(want_mem, emit, (syn_all, mem_all), 1), saved

    def _forward_on_host(
        self,
        syn: Tensor,
        mem: Tensor,
        z: Tensor,
        tensors: tuple[Tensor, Tensor, Tensor, Tensor],
        keep: bool,
        wants: tuple[bool, bool, Emit],
    ) -> tuple[list[Tensor], Tensor | None, Emitted, Any] | None:
        """`forward` through the compiled loop (`host_loops`), or None where it declines;
        ``wants``: ``(want_mem, want_y, emit)``."""
        a, b, thr, graded = tensors
        want_mem, want_y, emit = wants
        k = z.shape[0]
        fires = torch.empty((k + 1, *mem.shape), dtype=torch.bool, device=mem.device)
        torch.gt(mem - thr, 0, out=fires[0])
        hold = keep or want_mem
        ran = synaptic_forward_on_host(syn, mem, z, a, b, thr, self.reset, hold, fires)
        if ran is None:
            return None
        syns, mems = ran
        last = [syns[k], mems[k]] if hold else [syns[0], mems[0]]
        y = None
        if want_y:
            s = as_spikes(fires[1:])
            y = s if is_unit(graded) else s * graded
        saved = (syns, mems, fires) if keep else None
        states = [t.clone() for t in last] if hold else last
        return states, y, emitted(want_mem, emit, (syns, mems), 1), saved

    def backward(
        self,
        saved: Any,
        g_y: Tensor | None,
        g_final: list[Tensor | None],
        g_mem: EmittedGrad,
        need_z: bool,
        need_params: Sequence[bool],
        consume: bool = False,
        emit: Emit = None,
    ) -> tuple[Tensor | None, list[Tensor | None], list[Tensor | None]]:
        syns, mems, fired = saved
        alpha, beta, thr, graded = self.tensors()
        a, b = alpha.clamp(0, 1), beta.clamp(0, 1)
        k = mems.shape[0] - 1
        g_syns, g_mem = per_leaf(g_mem, emit, 2, 1)  # dL/d syn_t, mem_t given per step
        want = _wanted([alpha, beta, thr, graded], need_params)
        thr_grad = graded_grad = None
        if g_y is not None:
            g_s = g_y if is_unit(graded) else g_y * graded
            g_m = surrogate_grad(self.spike, mems[1:], thr, g_s, self.spike_grad)
            if want[2]:
                thr_grad = -reduce_to(g_m, thr)
            if want[3]:
                graded_grad = reduce_product(g_y, fired[1:], graded)
            del g_s
        else:
            g_m = torch.zeros_like(mems[1:])
        if g_mem is not None:
            g_m += g_mem
        keep_old = (~fired[:-1]).to(g_m.dtype) if self.reset == "zero_after" else None
        carry_m, carry_s = g_final[1], g_final[0]
        host = synaptic_backward_on_host(g_m, a, b, fired, self.reset, (carry_m, carry_s), g_syns)
        if host is not None:
            g_syn, carry_s, carry_m = host
        else:
            g_syn = torch.empty_like(g_m)
        for t in range(k - 1, -1, -1) if host is None else ():
            if carry_m is not None:
                g_m[t] += carry_m
            g_base = g_m[t] * keep_old[t] if keep_old is not None else g_m[t]
            carry_m = b * g_base
            if carry_s is None:
                g_syn[t] = g_base
            else:
                torch.add(g_base, carry_s, out=g_syn[t])
            if g_syns is not None:
                g_syn[t] += g_syns[t]
            carry_s = a * g_syn[t]
        if want[2] and self.reset == "subtract":
            part = reduce_product(g_m, fired[:-1], thr)
            thr_grad = -part if thr_grad is None else thr_grad - part
        if keep_old is not None:
            g_m.mul_(keep_old)  # dL/d base_t
        alpha_grad = clamp_grad(reduce_product(g_syn, syns[:-1], a), alpha) if want[0] else None
        beta_grad = clamp_grad(reduce_product(g_m, mems[:-1], b), beta) if want[1] else None
        grads = [alpha_grad, beta_grad, thr_grad, graded_grad]
        return (
            g_syn if need_z else None,
            [carry_s, carry_m],
            _aligned([alpha, beta, thr, graded], grads, need_params),
        )


#: Norse's feed-forward steps the `NorseKernel` reproduces
NorseMode = Literal["lif", "box", "li"]


class NorseFieldsKernel:
    """What the kernels of Norse's feed-forward cells with more state share (``LSNNCell``,
    ``LIFExCell``, ``LIFAdExCell``, ``IAFCell``, ``IzhikevichCell``, ...): the module's
    parameters read at each call, its time step, spike function, whether it still has the
    kernel's step, and the fields of its parameters the step reads (a field that takes a
    gradient keeps the per-step call, unless the kernel returns its gradient). A subclass
    names those fields (``fields``) and the leaves of the state the step carries
    (``leaf_count``).

    Args:
        params: ``() -> p``, the module's current parameter NamedTuple.
        dt: its time step.
        spike: ``u -> threshold(u, method, alpha)``.
        usable: ``() -> bool``, whether the module still has the step the kernel computes.
    """

    name = "fused"
    membrane: int | None = 0
    emits_states = False
    binary_leaves: tuple[int, ...] = ()
    binary_output = True
    #: the fields of ``p`` the step reads
    fields: tuple[str, ...] = ()
    #: the leaves of the state the step carries
    leaf_count = 0

    def __init__(
        self,
        params: Callable[[], Any],
        dt: float,
        spike: Callable[[Tensor], Tensor],
        usable: Callable[[], bool] = lambda: True,
    ) -> None:
        self.p = params
        self.dt = dt
        self.spike = spike
        self.usable = usable

    def fields_fit(self, p: Any, like: Tensor) -> bool:
        """Whether the parameters ``p`` are what the kernel computes with on ``like``'s
        device and dtype, none taking a gradient."""
        raise NotImplementedError

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        return (
            len(leaves) == self.leaf_count
            and self.usable()
            and _same_layout(leaves, z)
            and all(t.dtype == z.dtype for t in leaves)
            and self.fields_fit(self.p(), z)
        )

    @property
    def params(self) -> tuple[Tensor, ...]:
        """The fields that are tensors, none taking a gradient when the kernel runs: the
        kernel's check against the step samples along the dimensions where they vary (none
        given, a per-neuron ``beta`` failed that check and ``LSNNCell`` ran per step)."""
        p = self.p()
        return tuple(t for t in (getattr(p, f, None) for f in self.fields) if isinstance(t, Tensor))


class NorseKernel:
    """Norse's feed-forward steps (``lif_feed_forward_step``, ``lif_box_feed_forward_step``,
    ``li_feed_forward_step``), with Norse's parameter tensors and ``dt``:

    - ``"lif"`` (state ``(v, i)``): ``i' = i + z``; ``v_d = v + dt * tau_mem_inv * ((v_leak - v)
      + i')``; ``i_d = i' + -dt * tau_syn_inv * i'``; ``s = threshold(v_d - v_th)``;
      ``v_new = (1 - s) * v_d + s * v_reset``. The reset is differentiated (not detached),
      as in Norse.
    - ``"box"`` (state ``(v,)``): ``v_d = v + dt * tau_mem_inv * (z + v_leak - v)``, the same
      spike, the reset ``reset_value`` or ``reset_subtract`` (``(1 - s) * v_d + s * (v_d -
      v_th)``).
    - ``"li"`` (state ``(v, i)``, no spike: the output is ``v``): ``i' = i + z``; ``v' = v + dt
      * tau_mem_inv * ((v_leak - v) + i')``; ``i_d = i' + -dt * tau_syn_inv * i'``.

    Args:
        params: ``() -> p``, the cell's current parameter NamedTuple (tensor fields).
        dt: the cell's time step.
        spike: ``u -> threshold(u, method, alpha)`` (None for ``"li"``).
        mode: which step.
        subtract: ``"box"`` with ``reset_subtract``.
    """

    name = "fused"
    membrane: int | None = 0
    emits_states = False
    binary_leaves: tuple[int, ...] = ()

    @property
    def binary_output(self) -> bool:
        """Norse's spikes are 0 or 1; ``"li"`` outputs its membrane."""
        return self.mode != "li"

    def __init__(
        self,
        params: Callable[[], Any],
        dt: float,
        spike: Spike | None,
        mode: NorseMode,
        subtract: bool = False,
    ) -> None:
        self.p = params
        self.dt = dt
        self.spike = spike
        self.mode = mode
        self.subtract = subtract
        self.fields = (
            ("tau_mem_inv", "v_leak")
            + (("v_th", "v_reset") if mode != "li" else ())
            + (("tau_syn_inv",) if mode != "box" else ())
        )

    @property
    def params(self) -> tuple[Tensor, ...]:
        """The parameter fields that are tensors (a Python number, which Norse takes too
        and keeps in ``LIParameters`` / ``LIFBoxParameters``, needs no gradient)."""
        p = self.p()
        return tuple(t for t in (getattr(p, f) for f in self.fields) if isinstance(t, Tensor))

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        p = self.p()
        fields = [getattr(p, f) for f in self.fields]
        frozen = [getattr(p, "alpha", None)]
        return (
            len(leaves) == (1 if self.mode == "box" else 2)
            and _same_layout(leaves, z, [t for t in frozen if isinstance(t, Tensor)])
            and all(
                _is_number(t)
                or (
                    isinstance(t, Tensor)
                    and t.dtype == leaves[0].dtype
                    and (t.device == z.device or _host_scalar(t))
                )
                for t in fields
            )
            and all(t.dtype == z.dtype for t in leaves)
        )

    def forward(
        self,
        leaves: list[Tensor],
        z: Tensor,
        keep: bool,
        want_mem: bool,
        want_y: bool = True,
        into: Tensor | None = None,
        emit: Emit = None,
    ) -> tuple[list[Tensor], Tensor | None, Emitted, Any]:
        p = self.p()
        dt = self.dt
        c_m = dt * p.tau_mem_inv
        c_s = -dt * p.tau_syn_inv if self.mode != "box" else None
        v = leaves[0]
        i = leaves[1] if self.mode != "box" else None
        spiking = self.mode != "li"
        params = (c_m, p.v_leak, p.v_th if spiking else None, p.v_reset if spiking else None, c_s)
        if keep and not want_mem and emit is None and self._lean_slope(into is not None):
            lean = self._forward_lean(v, i, z, params, into, want_y)
            if lean is not None:
                return lean
        hold = keep or want_mem
        host = norse_forward_on_host(v, i, z, params, self.mode, self.subtract, hold)
        v_all: Tensor | None
        saved: tuple[Tensor | None, ...] | None
        if host is not None:
            v_all, i_all, y = host
            k = z.shape[0]
            final = [t[k].clone() if hold else t[0] for t in (v_all, i_all) if t is not None]
            saved = (v_all, i_all, z, y) if keep else None
            return final, y, v_all[1:] if want_mem else None, saved
        vs, is_, ys = [v], [i], []
        for z_t in z.unbind(0):
            if self.mode == "box":
                v = v + c_m * (z_t + p.v_leak - v)
            else:  # not "box": the current is a leaf and c_s a number
                i = cast(Tensor, i) + z_t
                v = v + c_m * ((p.v_leak - v) + i)
                i = i + cast("Tensor | float", c_s) * i
            if self.mode == "li":
                ys.append(v)
            else:
                s = norse_heaviside(v - p.v_th)
                ys.append(s)
                v = (1 - s) * v + s * (v - p.v_th) if self.subtract else (1 - s) * v + s * p.v_reset
            if keep or want_mem:
                vs.append(v)
                is_.append(i)
        y = torch.stack(ys)
        v_all = torch.stack(vs) if keep or want_mem else None
        saved = None
        if keep:
            saved = (
                v_all,
                None if self.mode == "box" else torch.stack(cast(list[Tensor], is_)),
                z,
                y,
            )
        final = [v] if self.mode == "box" else [v, cast(Tensor, i)]
        # want_mem implies the states were kept
        return final, y, cast(Tensor, v_all)[1:] if want_mem else None, saved

    def backward(
        self,
        saved: Any,
        g_y: Tensor | None,
        g_final: list[Tensor | None],
        g_mem: EmittedGrad,
        need_z: bool,
        need_params: Sequence[bool],
        consume: bool = False,
        emit: Emit = None,
    ) -> tuple[Tensor | None, list[Tensor | None], list[Tensor | None]]:
        g_mem = per_leaf(g_mem, emit, 1, 0)[0]  # the membrane's (leaf 0)
        if len(saved) == 1:  # `_forward_lean`'s
            return self._backward_lean(saved[0], g_y, g_final, g_mem, need_z, consume)
        vs, is_, z, y = saved  # (k + 1, B, ...) states, the input chunk, the outputs
        p = self.p()
        dt = self.dt
        c_m = dt * p.tau_mem_inv
        k = z.shape[0]
        box, li = self.mode == "box", self.mode == "li"
        learning = [f for f in self.fields if _requires_grad(getattr(p, f))]
        wanted = {f for f, n in zip(learning, need_params, strict=True) if n}
        # the forward's intermediates, every step at once (the same ops: bitwise the same)
        if box:
            i_new = None
            before = (z + p.v_leak) - vs[:-1]
        else:
            i_new = is_[:-1] + z
            before = (p.v_leak - vs[:-1]) + i_new
        v_d = vs[:-1] + c_m * before  # (k, B, ...): v before the reset (li: the new v)
        # kept only for the parameters' gradients that read them (a lower peak without)
        before = before if "tau_mem_inv" in wanted else None
        i_new = i_new if "tau_syn_inv" in wanted else None
        c_s = None if box else -dt * p.tau_syn_inv
        keep_i = None if c_s is None else 1 + c_s  # None exactly when box
        deriv = None
        if not li and self.spike is not None:
            deriv = surrogate_grad(self.spike, v_d, p.v_th, None)
        g_v, g_i = g_final[0], (None if box else g_final[1])
        one_minus_cm = 1 - c_m
        host = norse_backward_on_host(
            v_d,
            y,
            deriv,
            g_y,
            g_mem,
            (
                None if li else p.v_th,
                None if li else p.v_reset,
                one_minus_cm,
                c_m,
                None if box else keep_i,
            ),
            self.mode,
            self.subtract,
            (g_v, g_i),
            (
                bool(wanted & {"tau_mem_inv", "v_leak"}),
                "v_th" in wanted,
                "v_reset" in wanted or ("v_th" in wanted and self.subtract),
            ),
        )
        if host is not None:
            g_vd, g_u, g_in, g_vn_all, g_v, carry_i = host
            g_i = None if box else carry_i
        else:
            g_vd = torch.empty_like(v_d)
            g_u = None if li else torch.empty_like(v_d)
            g_in = None if box else torch.empty_like(v_d)  # dL/d i' per step
            g_vn_all = torch.empty_like(v_d)  # dL/d v after each step (its reset included)
        for t in range(k - 1, -1, -1) if host is None else ():
            g_vn = g_v
            if g_mem is not None:
                g_vn = g_mem[t] if g_vn is None else g_vn + g_mem[t]
            if g_vn is None:
                g_vn = torch.zeros_like(v_d[t])
            g_vn_all[t] = g_vn  # type: ignore[index]
            if li:
                g_here = g_vn if g_y is None else g_vn + g_y[t]
            else:
                s = y[t]
                ds = g_vn * (-p.v_th if self.subtract else p.v_reset - v_d[t])
                if g_y is not None:
                    ds = ds + g_y[t]
                g_s = ds * deriv[t] if deriv is not None else torch.zeros_like(ds)
                g_u[t] = g_s  # type: ignore[index]
                g_here = (g_vn if self.subtract else g_vn * (1 - s)) + g_s
            g_vd[t] = g_here  # type: ignore[index]
            g_v = g_here * one_minus_cm
            if not box:
                g_ii = g_i * cast("Tensor | float", keep_i) if g_i is not None else None
                g_in[t] = c_m * g_here if g_ii is None else c_m * g_here + g_ii  # type: ignore[index]
                g_i = g_in[t]  # type: ignore[index]
        g_z = None
        if need_z:
            g_z = c_m * g_vd if box else g_in
        g_i_state = [] if box else [g_i]
        # dL/d i_d per step: the state gradient entering each step from the next
        grads: list[tuple[Tensor, Callable[[], Tensor | None]]] = []

        def g_tau_mem() -> Tensor:
            assert g_vd is not None and before is not None
            return dt * (g_vd * before)

        def g_leak() -> Tensor:
            assert g_vd is not None
            return c_m * g_vd

        def g_th() -> Tensor:
            assert g_u is not None
            total = -g_u
            if self.subtract:
                assert g_vn_all is not None
                total = total - g_vn_all * y
            return total

        def g_reset() -> Tensor | None:
            # reset_subtract does not read v_reset: Norse gives it no gradient
            if self.subtract:
                return None
            assert g_vn_all is not None
            return g_vn_all * y

        def g_tau_syn() -> Tensor:
            assert g_in is not None and i_new is not None
            # i_d = i' + c_s * i': dL/dc_s = dL/di_d * i'; dL/di_d at step t is g_in[t+1]
            # (the next step's i' = i_d + z) or the final state's gradient
            g_id = torch.cat([g_in[1:], _or_zeros(g_final[1], g_in[0])[None]])
            return -dt * (g_id * i_new)

        makers = {
            "tau_mem_inv": g_tau_mem,
            "v_leak": g_leak,
            "v_th": g_th,
            "v_reset": g_reset,
            "tau_syn_inv": g_tau_syn,
        }
        grads = [(getattr(p, f), makers[f]) for f in self.fields]
        return g_z, [g_v, *g_i_state], _grads_for(grads, need_params)

    def _lean_slope(self, recomputing: bool) -> str | None:
        """The spike's slope (a `jit_loops.NORSE_SLOPES` name) where a chunk may keep only
        its membranes before each reset (`_forward_lean`): no field of ``p`` learnable, a
        slope the compiled backward takes (``"li"``: none, and only in a ``recomputing``
        chunk, whose input buffer it may take); else None."""
        if any(_requires_grad(getattr(self.p(), f)) for f in self.fields):
            return None
        if self.mode == "li":
            return "none" if recomputing else None
        if self.spike is None:
            return "none"
        find = getattr(self.spike, "host_slope", None)
        return find() if find is not None else None

    def _forward_lean(
        self,
        v: Tensor,
        i: Tensor | None,
        z: Tensor,
        params: tuple[Tensor | float | None, ...],
        into: Tensor | None,
        want_y: bool,
    ) -> tuple[list[Tensor], Tensor | None, None, tuple[Tensor]] | None:
        """`forward` keeping only the membranes before each reset ``(k, B, ...)``, over
        ``into[1:]`` (``z``'s rows) where given, else in a new tensor, as a 1-tuple (``"li"``'s
        backward reads no values there, only the buffer), or None where the compiled loop
        does not run."""
        pre = into[1:] if into is not None else z.new_empty(z.shape)  # contiguous
        host = norse_forward_on_host(v, i, z, params, self.mode, self.subtract, False, pre, want_y)
        if host is None:
            return None
        vs, is_, y = host
        final = [t[0] for t in (vs, is_) if t is not None]
        return final, y, None, (pre,)

    def _backward_lean(
        self,
        pre: Tensor,
        g_y: Tensor | None,
        g_final: list[Tensor | None],
        g_mem: Tensor | None,
        need_z: bool,
        consume: bool,
    ) -> tuple[Tensor | None, list[Tensor | None], list[Tensor | None]]:
        """`backward` from `_forward_lean`'s membranes (no field needs a gradient): one
        compiled pass (`norse_backward_lean_on_host`), ``dL/dz`` over them with
        ``consume``."""
        p = self.p()
        slope = self._lean_slope(True)
        if slope is None:
            raise ConfigError(
                "a Norse cell's spike method or a learnable field changed between the forward "
                "and the backward pass of one step; change them between training steps"
            )
        c_m = self.dt * p.tau_mem_inv
        box, li = self.mode == "box", self.mode == "li"
        keep_i = None if box else 1 + -self.dt * p.tau_syn_inv
        g_z, g_v, g_i = norse_backward_lean_on_host(
            pre,
            pre if consume else torch.empty_like(pre),
            g_y,
            g_mem,
            (None if li else p.v_th, None if li else p.v_reset, 1 - c_m, c_m, keep_i),
            slope,
            self.mode,
            self.subtract,
            (g_final[0], None if box else g_final[1]),
        )
        return g_z if need_z else None, [g_v] if box else [g_v, g_i], []


def _requires_grad(t: Any) -> bool:
    """Whether ``t`` is a tensor requiring grad (a parameter field the kernel differentiates)."""
    return isinstance(t, Tensor) and t.requires_grad


def _or_zeros(t: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if t is None else t
