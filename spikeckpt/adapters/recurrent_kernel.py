"""Chunk kernels of neurons with recurrent weights inside them: snnTorch ``RLeaky`` and
``RSynaptic`` (`RecurrentKernel`), Norse's ``LIFRecurrentCell`` (`NorseRecurrentKernel`).

Each step feeds the previous step's spikes back through the neuron's own recurrent map, so
the steps cannot be batched over the chunk as a block's synapse is; what the kernel saves is
autograd's bookkeeping: per step one matrix product and a few elementwise ops in the forward
pass, and in the backward pass one product with the recurrent weight (the spikes' gradient)
plus a few elementwise ops, the weight's own gradient summed over the whole chunk in one
product. Notation as in `spikeckpt.adapters.kernels`: ``z_t`` the synaptic input, ``r_t`` the
reset (spike of the membrane entering step ``t``, no gradient), ``s_t`` the spike, ``y_t = s_t
* graded``, fed back at step ``t + 1`` as ``rec(y_t)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from spikeckpt.adapters.affine import SparseLimit, weight_positions
from spikeckpt.adapters.gather import gather, gather_weight_grad
from spikeckpt.adapters.kernels import (
    Reset,
    SpikeGrad,
    SurrogateKernel,
    _aligned,
    _host_scalar,
    _keeps_dtype,
    _same_layout,
    _subtraction_is_exact,
    _wanted,
    as_spikes,
    clamp_grad,
    emitted,
    is_unit,
    norse_heaviside,
    per_leaf,
    reduce_product,
    reduce_to,
    scales,
    surrogate_grad,
)
from spikeckpt.adapters.recurrent_host import (
    lif_recurrent_backward_on_host,
    lif_recurrent_forward_on_host,
    recurrent_leaky_forward_on_host,
)
from spikeckpt.engine.compiled import is_compiling
from spikeckpt.engine.fused import Emit, Emitted, EmittedGrad

__all__ = [
    "InputGather",
    "NorseCellKernel",
    "NorseRecurrentKernel",
    "RecurrentKernel",
    "cell_fits",
    "fed_back_grad",
]


def _row(buffer: Tensor | None, t: int) -> Tensor | None:
    """Row ``t`` of ``buffer``, or None (an ``out=`` that makes a new tensor)."""
    return None if buffer is None else buffer[t]


def fed_back_grad(g: Tensor, spk0: Tensor, ys: Tensor) -> Tensor:
    """The recurrent weight's gradient over a chunk, ``sum_t g_t^T y_(t - 1)`` (``g``: dL/d
    the product's output ``(k, B, H)``; its input ``spk0 (B, H)`` at the first step, ``ys[t -
    1]`` after): one product for the chunk (two with the first step's)."""
    h = g.shape[-1]
    weight = g[0].reshape(-1, h).T @ spk0.reshape(-1, h)
    if g.shape[0] > 1:
        weight.addmm_(g[1:].reshape(-1, h).T, ys[:-1].reshape(-1, h))
    return weight


class RecurrentKernel(SurrogateKernel):
    """snnTorch ``RLeaky`` (``reset_delay=True``): previous spikes and one membrane; with
    ``synaptic``, ``RSynaptic``: previous spikes, synaptic current and membrane.

    Per step, as ``RLeaky.forward`` does it: ``r = (mem - thr > 0)`` (detached); ``base = b *
    mem + z + rec(spk)`` with ``rec`` the recurrent ``Linear`` (``F.linear(spk, W, bias)``) or
    the one-to-one ``spk * V``; ``mem = base - r * thr`` (``"subtract"``), ``base - r * base``
    (``"zero_after"``: snnTorch's ``"zero"``) or ``base``; ``spk = heaviside(mem - thr) *
    graded``; ``b = beta.clamp(0, 1)``. ``RSynaptic``: ``syn = a * syn + z + rec(spk)``,
    ``base = b * mem + syn``, ``a = alpha.clamp(0, 1)``, the same resets (of the membrane).
    The state's leaves are ``(spk, mem)`` or ``(spk, syn, mem)``.

    Args:
        tensors: ``() -> (beta, threshold, graded, W, bias)`` (bias may be None) or ``(beta,
            threshold, graded, V)``, the module's current tensors; with ``synaptic``,
            ``alpha`` first.
        linear: whether the recurrent map is the ``Linear`` (else ``spk * V``).
        spike: the surrogate spike function (its forward must be `heaviside`).
        reset: ``"subtract"``, ``"zero_after"`` or ``"none"``.
        spike_grad: the surrogate's backward written out, when the adapter knows it.
        usable: ``() -> bool``, whether the recurrent map is still what the kernel computes
            (no forward hook on it: the kernel never calls it), asked at every chunk.
        synaptic: ``RSynaptic``'s synaptic current between the input and the membrane.
    """

    def __init__(
        self,
        tensors: Callable[[], tuple[Any, ...]],
        linear: bool,
        spike: Callable[[Tensor], Tensor],
        reset: Reset,
        spike_grad: SpikeGrad | None = None,
        usable: Callable[[], bool] = lambda: True,
        synaptic: bool = False,
    ) -> None:
        super().__init__(tensors, spike, reset, spike_grad)
        self.linear = linear
        self.usable = usable
        self.synaptic = synaptic
        self.membrane: int | None = 2 if synaptic else 1
        #: RSynaptic emits its current and membrane per step (``output=True`` at the top)
        self.emits_states = synaptic

    @property
    def params(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors() if t is not None)

    @property
    def binary_output(self) -> bool:
        """Whether the spikes are 0 or 1: the graded factor a fixed 1."""
        return is_unit(self._split()[3])

    @property
    def binary_leaves(self) -> tuple[int, ...]:
        """The state's spikes (its first leaf) while they are 0 or 1."""
        return (0,) if self.binary_output else ()

    def _split(self) -> tuple[Tensor | None, Tensor, Tensor, Tensor, list[Tensor | None]]:
        """``(alpha or None, beta, threshold, graded, the recurrent map's tensors)``."""
        tensors: tuple[Any, ...] = self.tensors()  # the bias may be None
        if not self.synaptic:
            tensors = (None, *tensors)
        alpha, beta, thr, graded, *recurrent = tensors
        return alpha, beta, thr, graded, recurrent

    def _rec(self, spk: Tensor, recurrent: Sequence[Tensor | None]) -> Tensor:
        """The recurrent map of the previous spikes ``(B, H) -> (B, H)``."""
        if self.linear:
            return F.linear(spk, recurrent[0], recurrent[1])  # type: ignore[arg-type]
        return spk * recurrent[0]  # type: ignore[operator]

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        return (
            len(leaves) == (3 if self.synaptic else 2)
            and self.usable()
            and _same_layout(leaves, z)
            and _keeps_dtype(self, leaves, z)
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
        alpha, beta, thr, graded, recurrent = self._split()
        a = None if alpha is None else alpha.clamp(0, 1)
        b = beta.clamp(0, 1)
        spk0, mem = leaves[0], leaves[-1]
        syn = leaves[1] if self.synaptic else None
        k = z.shape[0]
        hold = keep or want_mem
        # membranes, spikes and resets straight into their buffers (out=: the same values)
        mems = mem.new_empty((k + 1, *mem.shape)) if hold else None
        emits_syn = want_mem and emit is not None and 1 in emit
        # the currents: emitted, or read by alpha's gradient (nothing else in the backward)
        learns_alpha = keep and alpha is not None and alpha.requires_grad
        syns = (
            mem.new_empty((k + 1, *mem.shape))
            if (learns_alpha or emits_syn) and syn is not None
            else None
        )
        fires = torch.empty((k + 1, *mem.shape), dtype=torch.bool, device=mem.device)
        dtype = torch.result_type(torch.ones(1), graded)  # a float32 spike's times graded
        ys = torch.empty((k, *mem.shape), dtype=dtype, device=mem.device)
        if mems is not None:
            mems[0] = mem
        if syns is not None:
            syns[0] = cast(Tensor, syn)  # syns only with a current
        # then (mem - thr > 0) == (mem > thr); compiled: snnTorch's own form (no host read)
        exact = not is_compiling() and _subtraction_is_exact(mem.device)
        torch.gt(mem - thr, 0, out=fires[0])
        thr_off = thr * 0
        spk = spk0.clone()  # (a view of a stored state may sit at another alignment)
        host = recurrent_leaky_forward_on_host(
            z,
            (spk0, syn, mem),
            (a, b, thr, graded),
            lambda s: self._rec(s, recurrent),
            (self.reset, exact),
            (fires, ys, mems, syns),
        )
        if host is not None:
            spk, syn, mem = host
        for t, z_t in enumerate(z.unbind(0) if host is None else ()):
            fired, out = fires[t], (mems[t + 1] if mems is not None else None)
            if syn is not None:  # RSynaptic: the current, then the membrane
                syn = torch.add(
                    cast(Tensor, a) * syn + z_t, self._rec(spk, recurrent), out=_row(syns, t + 1)
                )
                base = b * mem + syn
            else:
                base = b * mem + z_t + self._rec(spk, recurrent)
            if self.reset == "subtract":
                mem = torch.sub(base, torch.where(fired, thr, thr_off), out=out)
            elif self.reset == "zero_after":
                mem = torch.sub(base, fired.to(base.dtype) * base, out=out)
            else:
                mem = base if out is None else out.copy_(base)
            if exact:
                torch.gt(mem, thr, out=fires[t + 1])
            else:
                torch.gt(mem - thr, 0, out=fires[t + 1])
            # snnTorch's spike: heaviside (float32) times the factor, a tensor of its own: a
            # matrix product's sums may round differently on a view at another alignment
            spk = as_spikes(fires[t + 1]) * graded
            ys[t] = spk
        saved = (mems, syns, fires, spk0, ys) if keep else None
        final = [spk, mem.clone() if mems is not None else mem]
        if syn is not None:
            final.insert(1, syn.clone() if syns is not None else syn)
        held = (None, syns, mems) if syn is not None else (None, mems)
        return final, ys if want_y else None, emitted(want_mem, emit, held, len(held) - 1), saved

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
        # (k + 1, B, H) membranes, currents (RSynaptic) and spikes (bool: r_t at t < k,
        # s_t at t > 0); the initial spikes (B, H); the spikes (k, B, H)
        mems, syns, fired, spk0, ys = saved
        n = 3 if self.synaptic else 2
        g_leaves = per_leaf(g_mem, emit, n, n - 1)
        g_mem = g_leaves[n - 1]  # the membrane's (the last leaf)
        g_syn = g_leaves[1] if self.synaptic else None  # the emitted current's, per step
        alpha, beta, thr, graded, recurrent = self._split()
        a = None if alpha is None else alpha.clamp(0, 1)
        b = beta.clamp(0, 1)
        k = mems.shape[0] - 1
        tensors = [t for t in (alpha, beta, thr, graded, *recurrent) if t is not None]
        want = _wanted(tensors, need_params)
        if alpha is None:
            want.insert(0, False)
        # d spike / d u at every step, once for the chunk, where the surrogate's backward is
        # a slope times the incoming gradient (`scales`: atan's); else the written backward,
        # or the spike function's own, gets each step's gradient, as in the loop (a user's
        # may clip it: slope * g differed; fast_sigmoid's divides: not bitwise)
        slope = (
            surrogate_grad(self.spike, mems[1:], thr, None, self.spike_grad)
            if scales(self.spike_grad)
            else None
        )
        g_u = torch.empty_like(ys) if slope is None and want[2] else None  # dL/d u, per step
        # dL/d the membrane before its reset, per step; RSynaptic keeps it for the chunk only
        # where a gradient reads it (beta's, a subtracted threshold's)
        whole = a is None or want[1] or (want[2] and self.reset == "subtract")
        g_base = torch.empty_like(mems[1:]) if whole else torch.empty_like(mems[:1])
        g_in = torch.empty_like(mems[1:]) if a is not None else g_base  # dL/d z_t, rec_t
        # dL/d y_t, every path: kept for the threshold's and the factor's gradients
        g_spikes = torch.empty_like(ys) if want[2] or want[3] else None
        carry_spk, carry_mem = g_final[0], g_final[-1]
        carry_syn = g_final[1] if a is not None else None
        for t in range(k - 1, -1, -1):
            g_s = (
                carry_spk if g_y is None else (g_y[t] if carry_spk is None else g_y[t] + carry_spk)
            )
            if g_s is None:
                g_s = torch.zeros_like(ys[t])
            if g_spikes is not None:
                g_spikes[t] = g_s
            if slope is not None:
                g_m = slope[t] * (g_s * graded)  # dL/d mem_t through the spike
            else:
                mem_t, g_spike = mems[t + 1 : t + 2], (g_s * graded)[None]
                g_m = surrogate_grad(self.spike, mem_t, thr, g_spike, self.spike_grad)[0]
                if g_u is not None:
                    g_u[t] = g_m
            if carry_mem is not None:
                g_m = g_m + carry_mem
            if g_mem is not None:
                g_m = g_m + g_mem[t]
            row = g_base[t] if whole else g_base[0]
            if self.reset == "zero_after":
                torch.mul(g_m, (~fired[t]).to(g_m.dtype), out=row)
            else:
                row.copy_(g_m)
            carry_mem = b * row
            if a is not None:  # syn_t feeds base_t and syn_(t + 1)
                if carry_syn is None:
                    g_in[t] = row
                else:
                    torch.add(row, carry_syn, out=g_in[t])
                if g_syn is not None:
                    g_in[t] += g_syn[t]
                carry_syn = a * g_in[t]
            carry_spk = self._rec_grad(g_in[t], recurrent)
        grads: list[Tensor | None] = [None, None, None, None]
        if want[0]:
            assert alpha is not None and a is not None
            grads[0] = clamp_grad(reduce_product(g_in, syns[:-1], a), alpha)
        if want[1]:
            grads[1] = clamp_grad(reduce_product(g_base, mems[:-1], b), beta)
        if want[2]:
            # spike(mem - thr): -(slope * graded * g_s); subtract: mem = base - r * thr
            if slope is not None:
                thr_grad = -reduce_product(slope, g_spikes * graded, thr)  # type: ignore[operator]
            else:
                assert g_u is not None
                thr_grad = -reduce_to(g_u, thr)
            if self.reset == "subtract":
                thr_grad = thr_grad - reduce_product(g_base, fired[:-1], thr)
            grads[2] = thr_grad
        if want[3]:  # y = s * graded, fed back and output: dL/d graded = sum(dL/d y * s)
            grads[3] = reduce_product(g_spikes, fired[1:], graded)  # type: ignore[arg-type]
        grads += self._recurrent_grads(g_in, spk0, ys, recurrent, want[4:])
        if alpha is None:
            grads.pop(0)
        initial = [carry_spk, carry_mem] if a is None else [carry_spk, carry_syn, carry_mem]
        return g_in if need_z else None, initial, _aligned(tensors, grads, need_params)

    def _rec_grad(self, g: Tensor, recurrent: Sequence[Tensor | None]) -> Tensor:
        """dL/d spk through the recurrent map, given dL/d its output ``g (B, H)``."""
        if self.linear:
            return g @ recurrent[0]  # type: ignore[operator]
        return g * recurrent[0]  # type: ignore[operator]

    def _recurrent_grads(
        self,
        g: Tensor,
        spk0: Tensor,
        ys: Tensor,
        recurrent: Sequence[Tensor | None],
        want: Sequence[bool],
    ) -> list[Tensor | None]:
        """The recurrent map's parameters' gradients over the chunk (``g``: dL/d its output
        ``(k, B, H)``; its input: ``spk0`` at the first step, ``ys[t - 1]`` at step ``t``),
        aligned with the tensors that are not None."""
        first = spk0.to(ys.dtype)
        if not self.linear:
            if not want[0]:
                return [None]
            v = recurrent[0]
            assert v is not None
            grad = reduce_to(g[0] * first, v)
            return [grad + reduce_product(g[1:], ys[:-1], v) if g.shape[0] > 1 else grad]
        h = g.shape[-1]
        out: list[Tensor | None] = [fed_back_grad(g, first, ys) if want[0] else None]
        if recurrent[1] is not None:
            out.append(g.reshape(-1, h).sum(0) if want[1] else None)
        return out


class InputGather:
    """The input product ``x W_in^T`` of a Norse cell weighting its own input, over a chunk:
    on the CPU, for a chunk with few non-zeros (the share at which a ``Linear`` of the cell's
    width gathers, `spikeckpt.adapters.affine.sparse_share`) and no gradient wanted for it,
    one gather over the non-zeros (`spikeckpt.adapters.gather`), and ``W_in``'s gradient
    another: equal to the cell's per-step products within float32 round-off (a sum in
    another order), as the first ``Linear`` of an snnTorch net gathers. ``gathers = False``
    (``wrap(..., exact=True)``) keeps the cell's own product per step: bitwise the loop's."""

    def __init__(self) -> None:
        self.gathers = True
        self.limit = SparseLimit()  # the forward pass's path, kept for its recomputation

    @torch.compiler.disable  # host reads: a compiled forward runs it eagerly, silently
    def current(self, x: Tensor, w_in: Tensor) -> tuple[Tensor | None, Gathered]:
        """``x W_in^T (k, B, H)`` of the chunk ``x (k, B, n_in)`` and what `weight_grad`
        reads, ``(rows, columns, values or None for ones)`` of the non-zeros, where it
        gathers; else ``None`` and ``(x, None, None)``: the product per step."""
        found = weight_positions(x, w_in, self.limit) if self.gathers else None
        if found is None:
            return None, (x, None, None)
        n_rows, rows, cols, values = found
        current = gather(w_in, n_rows, rows, cols, values)
        return current.reshape(*x.shape[:-1], w_in.shape[0]), (rows, cols, values)

    @staticmethod
    def weight_grad(g: Tensor, held: Gathered, w_in: Tensor) -> Tensor:
        """``W_in``'s gradient over the chunk from ``g`` (dL/d the product, ``(k, B, H)``)
        and what `current` returned to keep."""
        flat = g.reshape(-1, w_in.shape[0])
        first, cols, values = held
        if cols is None:  # the dense input
            return flat.T @ first.reshape(-1, first.shape[-1])
        shape = (w_in.shape[0], w_in.shape[1])
        return gather_weight_grad(flat, first, cols, values, shape, None)


def cell_fits(leaves: Sequence[Tensor], z: Tensor, w_in: Tensor, w_rec: Tensor) -> bool:
    """Whether a Norse cell weighting its own input fits the chunk ``z (k, B, n_in)``: a
    floating input, every state leaf ``(B, H)`` of its dtype and device, ``W_in (H, n_in)``
    and ``W_rec`` of its dtype."""
    hidden = w_rec.shape[0]
    return (
        z.is_floating_point()
        and all(
            t.shape == (z.shape[1], hidden) and t.dtype == z.dtype and t.device == z.device
            for t in leaves
        )
        and w_in.shape == (hidden, z.shape[2])
        and w_in.dtype == w_rec.dtype == z.dtype
    )


#: what `InputGather.current` keeps for the weight's gradient
Gathered = tuple[Tensor, Tensor | None, Tensor | None]


class NorseCellKernel:
    """What the kernels of Norse's recurrent cells share: the cell's tensors, time step,
    spike function, whether it still has the kernel's step, and its input product.

    Args:
        tensors: ``() -> (p, W_in, W_rec)``, the cell's current parameters and weights.
        dt: the cell's time step.
        spike: ``u -> threshold(u, method, alpha)``.
        usable: ``() -> bool``, whether the cell still has the step the kernel computes.
    """

    name = "fused"
    membrane: int | None = 1
    emits_states = False
    #: the state's first leaf is the last step's spikes, Norse's ``threshold``: 0 or 1
    binary_leaves: tuple[int, ...] = (0,)
    binary_output = True

    def __init__(
        self,
        tensors: Callable[[], tuple[Any, Tensor, Tensor]],
        dt: float,
        spike: Callable[[Tensor], Tensor],
        usable: Callable[[], bool] = lambda: True,
    ) -> None:
        self.tensors = tensors
        self.dt = dt
        self.spike = spike
        self.usable = usable
        self.inputs = InputGather()


class NorseRecurrentKernel(NorseCellKernel):
    """Norse's ``LIFRecurrentCell`` step (``lif_step``): the state
    ``(z, v, i)`` (previous spikes, membrane, current), the block's input ``x (k, B, n_in)``
    weighted inside the cell.

    Per step, as ``lif_step`` does it: ``j = i + x_t W_in^T + z W_rec^T``; ``v_d = v + dt *
    tau_mem_inv * ((v_leak - v) + j)``; ``i = j + -dt * tau_syn_inv * j``; ``z = threshold(v_d -
    v_th)``; ``v = (1 - z) * v_d + z * v_reset`` (the spike detached in the reset, as Norse
    does). The weights and any tensor field of ``p`` (``tau_mem_inv``, ``tau_syn_inv``,
    ``v_leak``, ``v_th``, ``v_reset``) may take gradients.

    The input's product: gathered over a sparse chunk's non-zeros where it may be
    (`InputGather`), else per step as the cell's. Arguments as `NorseCellKernel`'s.
    """

    fields = ("tau_mem_inv", "tau_syn_inv", "v_leak", "v_th", "v_reset")

    @property
    def params(self) -> tuple[Tensor, ...]:
        p, w_in, w_rec = self.tensors()
        return (w_in, w_rec, *(getattr(p, f) for f in self.fields))

    def _learning(self, p: Any) -> set[str]:
        """The fields of ``p`` that take gradients."""
        return {f for f in self.fields if getattr(p, f).requires_grad}

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        if len(leaves) != 3 or not self.usable() or z.dim() != 3:
            return False
        p, w_in, w_rec = self.tensors()
        values = [getattr(p, f, None) for f in self.fields]
        return (
            all(
                isinstance(t, Tensor)
                and t.dtype == z.dtype
                and (t.device == z.device or (t.dim() == 0 and _host_scalar(t)))
                for t in values
            )
            and not any(isinstance(t, Tensor) and t.requires_grad for t in (p.alpha,))
            and cell_fits(leaves, z, w_in, w_rec)
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
    ) -> tuple[list[Tensor], Tensor | None, Tensor | None, Any]:
        p, w_in, w_rec = self.tensors()
        c_m = self.dt * p.tau_mem_inv
        c_s = -self.dt * p.tau_syn_inv
        spk0, v, i = leaves
        k = z.shape[0]
        ys = v.new_empty((k, *v.shape))
        v_ds = v.new_empty((k, *v.shape)) if keep else None  # before the reset
        vs = v.new_empty((k, *v.shape)) if want_mem else None
        # a learnable tau_mem_inv's gradient reads each step's drive ``(v_leak - v) + j``, a
        # learnable tau_syn_inv's its current jump ``j``
        learning = self._learning(p) if keep else set()
        drives = v.new_empty((k, *v.shape)) if "tau_mem_inv" in learning else None
        jumps = v.new_empty((k, *v.shape)) if "tau_syn_inv" in learning else None
        spk = spk0.clone()  # (a view of a stored state may sit at another alignment)
        # the input's product gathered over a sparse chunk's non-zeros, else per step as the
        # cell's: one dense product for the chunk took as long (measured) and rounds
        # differently for one row (a matrix-vector product)
        current, held = self.inputs.current(z, w_in)
        params = (c_m, p.v_leak, p.v_th, p.v_reset, c_s)
        kept = (v_ds, vs, drives, jumps)
        host = lif_recurrent_forward_on_host(leaves, z, current, (w_in, w_rec), params, ys, kept)
        if host is not None:
            spk, v, i = host
        for t, x_t in enumerate(z.unbind(0) if host is None else ()):
            fed = F.linear(x_t, w_in) if current is None else current[t]
            jump = i + fed + F.linear(spk, w_rec)
            drive = (p.v_leak - v) + jump
            v_d = v + c_m * drive
            if drives is not None:
                drives[t] = drive
            if jumps is not None:
                jumps[t] = jump
            i = jump + c_s * jump
            spk = norse_heaviside(v_d - p.v_th)
            v = (1 - spk) * v_d + spk * p.v_reset
            ys[t] = spk
            if v_ds is not None:
                v_ds[t] = v_d
            if vs is not None:
                vs[t] = v
        # a gathered chunk keeps its non-zeros (W_in's gradient) instead of the dense input
        saved = (v_ds, ys, spk0, drives, jumps, *held) if keep else None
        return [spk, v, i], ys if want_y else None, vs, saved

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
        g_mem = per_leaf(g_mem, emit, 3, 1)[1]  # the membrane's
        # (k, B, H) the membranes before the reset, the spikes; (B, H); with a learnable
        # tau_mem_inv, (k, B, H) each step's drive; with a learnable tau_syn_inv, its current
        # jump; what `InputGather.current` keeps
        v_ds, ys, spk0, drives, jumps, *held = saved
        p, w_in, w_rec = self.tensors()
        tensors = [w_in, w_rec, *(getattr(p, f) for f in self.fields)]
        want = _wanted(tensors, need_params)
        # per step, for p's gradients, those they read: dL/d v_d ("vd"), dL/d the current
        # after the step ("i"), dL/d the membrane after the reset ("v"), dL/d the spike ("s")
        learn = dict(zip(self.fields, want[2:], strict=True))
        reads = {
            "vd": learn["tau_mem_inv"] or learn["v_leak"],
            "i": learn["tau_syn_inv"],
            "v": learn["v_reset"],
            "s": learn["v_th"],
        }
        per_step = {name: torch.zeros_like(ys) for name, read in reads.items() if read}
        c_m = self.dt * p.tau_mem_inv
        c_s = -self.dt * p.tau_syn_inv
        slope = surrogate_grad(self.spike, v_ds, p.v_th, None, overwrite=consume)
        g_jump = torch.empty_like(ys)  # dL/d j_t
        steps = cast(Any, tuple(per_step.get(name) for name in ("vd", "i", "v", "s")))
        host = lif_recurrent_backward_on_host(
            g_y, g_final, g_mem, slope, ys, w_rec, (c_m, c_s), g_jump, steps
        )
        if host is None:  # the torch loop
            host = self._backward_loop(g_y, g_final, g_mem, slope, ys, (c_m, c_s), g_jump, per_step)
        carry_z, carry_v, carry_i = host
        grads: list[Tensor | None] = [None] * len(tensors)
        if per_step:
            grads[2:] = self._p_grads(p, want[2:], per_step, slope, drives, jumps, ys)
        del slope, per_step  # (k, B, H) each: gone before the weights' gradients
        if want[0]:
            grads[0] = self.inputs.weight_grad(g_jump, tuple(held), w_in)
        if want[1]:
            grads[1] = fed_back_grad(g_jump, spk0.to(ys.dtype), ys)
        g_x = (g_jump @ w_in) if need_z else None
        return g_x, [carry_z, carry_v, carry_i], _aligned(tensors, grads, need_params)

    def _backward_loop(
        self,
        g_y: Tensor | None,
        g_final: Sequence[Tensor | None],
        g_mem: Tensor | None,
        slope: Tensor,
        ys: Tensor,
        rates: tuple[Tensor, Tensor],
        g_jump: Tensor,
        per_step: dict[str, Tensor],
    ) -> list[Tensor | None]:
        """`backward`'s loop from the last step to the first in torch (where the compiled one,
        `lif_recurrent_backward_on_host`, declines): fills ``g_jump`` and ``per_step``'s
        buffers, returns the carries into the states before the chunk."""
        c_m, c_s = rates
        w_rec = self.tensors()[2]
        keep_v = 1 - ys  # the reset's factor of v_d (the spike detached)
        carry_z, carry_v, carry_i = g_final
        for t in range(ys.shape[0] - 1, -1, -1):
            g_s = carry_z if g_y is None else (g_y[t] if carry_z is None else g_y[t] + carry_z)
            g_v = (
                carry_v if g_mem is None else (g_mem[t] if carry_v is None else g_mem[t] + carry_v)
            )
            g_vd = slope[t] * g_s if g_s is not None else torch.zeros_like(ys[t])
            if g_v is not None:
                g_vd = g_vd + g_v * keep_v[t]
            g_j = g_vd * c_m  # v_d = v + c_m * ((v_leak - v) + j)
            if carry_i is not None:  # i = j + c_s * j: both terms, as autograd adds them
                g_j = g_j + (carry_i + carry_i * c_s)
            g_jump[t] = g_j
            if per_step:
                for name, g in (("vd", g_vd), ("i", carry_i), ("v", g_v), ("s", g_s)):
                    buffer = per_step.get(name)
                    if buffer is not None and g is not None:
                        buffer[t] = g
            carry_v = g_vd - g_vd * c_m
            carry_i = g_j
            carry_z = g_j @ w_rec
        return [carry_z, carry_v, carry_i]

    def _p_grads(
        self,
        p: Any,
        want: Sequence[bool],
        per_step: dict[str, Tensor],
        slope: Tensor,
        drives: Tensor | None,
        jumps: Tensor | None,
        ys: Tensor,
    ) -> list[Tensor | None]:
        """The gradients of ``p``'s fields (`fields` order; None where not wanted), from the
        per-step dL/d v_d, dL/d the current after the step (the next step's ``j``), dL/d the
        membrane after the reset and dL/d the spike, ``(k, B, H)`` each (those read), each
        step's drive and current jump (where read)."""
        kept = {**per_step, "drives": drives, "jumps": jumps}

        def read(name: str) -> Tensor:
            found = kept.get(name)
            if found is None:  # the forward pass keeps what every learnable field reads
                raise AssertionError(f"no {name} kept for a learnable field's gradient")
            return found

        dt = self.dt
        c_m = dt * p.tau_mem_inv
        makers: dict[str, Callable[[Tensor], Tensor]] = {
            # v_d = v + dt * tau_mem_inv * drive, drive = (v_leak - v) + j
            "tau_mem_inv": lambda t: reduce_product(read("vd"), read("drives"), t) * dt,
            # i = j + -dt * tau_syn_inv * j
            "tau_syn_inv": lambda t: reduce_product(read("i"), read("jumps"), t) * -dt,
            "v_leak": lambda t: reduce_product(read("vd"), c_m.expand_as(read("vd")), t),
            # z = threshold(v_d - v_th)
            "v_th": lambda t: -reduce_product(slope, read("s"), t),
            "v_reset": lambda t: reduce_product(read("v"), ys, t),  # v = (1 - z) v_d + z v_reset
        }
        return [
            makers[f](getattr(p, f)) if w else None for f, w in zip(self.fields, want, strict=True)
        ]
