"""The chunk kernels of Norse's LSNN neurons, LIF neurons whose threshold adapts:
``LSNNRecurrentCell`` (``lsnn_step``, `NorseLSNNKernel`: its input and recurrent weights
inside the cell) and ``LSNNCell`` / ``LSNN`` (``lsnn_feed_forward_step``,
`NorseLSNNFeedForwardKernel`: the input is the current's jump).

Per step, as ``lsnn_step`` does it, from the state ``(z, v, i, b)`` (previous spikes,
membrane, current, adaptive threshold)::

    v_d = v + dt * tau_mem_inv * ((v_leak - v) + i)      the membrane reads the old current
    i_d = i + -dt * tau_syn_inv * i
    b_d = b + dt * tau_adapt_inv * (v_th - b)
    z' = threshold(v_d - b_d)
    v' = (1 - z') * v_d + z' * v_reset                   (z' detached, as Norse does)
    i' = i_d + x_t W_in^T + z W_rec^T
    b' = b_d + z' * beta                                 (z' detached)

The recurrent product needs the previous spikes, so it stays a product per step; the input's
is gathered over a sparse chunk where it may be (`InputGather`). The backward runs the
adjoint recurrence by hand: the spike's gradient reaches the state only through the next
step's recurrent product (the reset and the adaptation take the spike detached). On the CPU
both passes run each step's elementwise part compiled beside torch's products
(`spikeckpt.adapters.recurrent_host`), bitwise the torch loops.

The feed-forward step, from ``(v, i, b)``, is the same but for the current, ``i' = i_d +
x_t``, and the spike, which Norse does not detach there: the reset and the adaptation pass
its gradient through the surrogate too. Either kernel keeps the per-step call for
``LSNNParameters`` with a field that takes a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from spikeckpt.adapters.kernels import (
    NorseFieldsKernel,
    _aligned,
    _host_scalar,
    _wanted,
    norse_heaviside,
    per_leaf,
    surrogate_grad,
)
from spikeckpt.adapters.recurrent_host import (
    lsnn_recurrent_backward_on_host,
    lsnn_recurrent_forward_on_host,
)
from spikeckpt.adapters.recurrent_kernel import NorseCellKernel, cell_fits, fed_back_grad
from spikeckpt.engine.fused import Emit, EmittedGrad

__all__ = ["NorseLSNNFeedForwardKernel", "NorseLSNNKernel"]

#: the fields of ``LSNNParameters`` the steps read
FIELDS = ("tau_syn_inv", "tau_mem_inv", "tau_adapt_inv", "v_leak", "v_th", "v_reset", "beta")


def _rates(p: Any, dt: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dt * tau_mem_inv, -dt * tau_syn_inv, dt * tau_adapt_inv)``, as Norse's steps form
    them (the same products: the same values)."""
    return dt * p.tau_mem_inv, -dt * p.tau_syn_inv, dt * p.tau_adapt_inv


def _fixed_fields(p: Any, like: Tensor) -> bool:
    """Whether every field of ``p`` is a tensor without grad of ``like``'s dtype, on its
    device (or a 0-d host scalar), and ``alpha`` takes no gradient."""
    alpha = getattr(p, "alpha", None)
    return all(
        isinstance(t, Tensor)
        and not t.requires_grad
        and t.dtype == like.dtype
        and (t.device == like.device or (t.dim() == 0 and _host_scalar(t)))
        for t in (getattr(p, f, None) for f in FIELDS)
    ) and not (isinstance(alpha, Tensor) and alpha.requires_grad)


class NorseLSNNKernel(NorseCellKernel):
    """Norse's ``LSNNRecurrentCell`` step over a chunk (see the module docstring; arguments
    as `NorseCellKernel`'s)."""

    #: the input current reaches the voltage a step later: the spikes of step 0 come from the
    #: initial state alone (`spikeckpt.engine.layerwise` runs T = 1 per step)
    input_delay = 1

    @property
    def params(self) -> tuple[Tensor, ...]:
        _, w_in, w_rec = self.tensors()
        return (w_in, w_rec)

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        if len(leaves) != 4 or not self.usable() or z.dim() != 3:
            return False
        p, w_in, w_rec = self.tensors()
        return _fixed_fields(p, z) and cell_fits(leaves, z, w_in, w_rec)

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
        c_m, c_s, c_a = _rates(p, self.dt)
        spk0, v, i, b = leaves
        k = z.shape[0]
        ys = v.new_empty((k, *v.shape))
        us = v.new_empty((k, *v.shape)) if keep else None  # v_d - b_d: the surrogate's input
        vs = v.new_empty((k, *v.shape)) if want_mem else None
        spk = spk0.clone()  # (a view of a stored state may sit at another alignment)
        current, held = self.inputs.current(z, w_in)
        # on the CPU each step's elementwise part compiled (`recurrent_host`), bitwise
        params = (c_m, c_s, c_a, p.v_leak, p.v_th, p.v_reset, p.beta)
        host = lsnn_recurrent_forward_on_host(
            leaves, z, current, (w_in, w_rec), params, ys, (us, vs)
        )
        if host is not None:
            spk, v, i, b = host
        for t, x_t in enumerate(z.unbind(0) if host is None else ()):
            v_d = v + c_m * ((p.v_leak - v) + i)
            i_d = i + c_s * i
            b_d = b + c_a * (p.v_th - b)
            u = v_d - b_d
            fired = norse_heaviside(u)
            v = (1 - fired) * v_d + fired * p.v_reset
            fed = F.linear(x_t, w_in) if current is None else current[t]
            i = i_d + fed + F.linear(spk, w_rec)
            b = b_d + fired * p.beta
            spk = fired
            ys[t] = spk
            if us is not None:
                us[t] = u
            if vs is not None:
                vs[t] = v
        saved = (us, ys, spk0, *held) if keep else None
        return [spk, v, i, b], ys if want_y else None, vs, saved

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
        g_mem = per_leaf(g_mem, emit, 4, 1)[1]  # the membrane's
        # (k, B, H) each step's v_d - b_d and spikes; (B, H) the spikes entering the chunk;
        # what `InputGather.current` keeps
        us, ys, spk0, *held = saved
        p, w_in, w_rec = self.tensors()
        tensors = [w_in, w_rec]
        want = _wanted(tensors, need_params)
        c_m, c_s, c_a = _rates(p, self.dt)
        slope = surrogate_grad(
            self.spike, us, torch.zeros((), dtype=us.dtype), None, overwrite=consume
        )
        g_jump = torch.empty_like(ys)  # dL/d i' per step: the products' outputs
        # on the CPU each step's elementwise part compiled (`recurrent_host`), bitwise
        carries = lsnn_recurrent_backward_on_host(
            g_y, g_final, g_mem, slope, ys, w_rec, (c_m, c_s, c_a), g_jump
        )
        if carries is None:
            carries = self._backward_loop(g_y, g_final, g_mem, slope, ys, (c_m, c_s, c_a), g_jump)
        del slope
        grads: list[Tensor | None] = [None, None]
        if want[0]:
            grads[0] = self.inputs.weight_grad(g_jump, (held[0], held[1], held[2]), w_in)
        if want[1]:
            grads[1] = fed_back_grad(g_jump, spk0.to(ys.dtype), ys)
        g_x = (g_jump @ w_in) if need_z else None
        return g_x, list(carries), _aligned(tensors, grads, need_params)

    def _backward_loop(
        self,
        g_y: Tensor | None,
        g_final: Sequence[Tensor | None],
        g_mem: Tensor | None,
        slope: Tensor,
        ys: Tensor,
        rates: tuple[Tensor, Tensor, Tensor],
        g_jump: Tensor,
    ) -> list[Tensor]:
        """`backward`'s loop from the last step to the first in torch (where the compiled one,
        `lsnn_recurrent_backward_on_host`, declines): fills ``g_jump`` ``(k, B, H)``, returns
        the carries into the states before the chunk ``[spikes, membrane, current,
        threshold]``."""
        c_m, c_s, c_a = rates
        w_rec = self.tensors()[2]
        keep_v = 1 - ys  # the reset's factor of v_d (the spike detached)
        carry_z, carry_v, carry_i, carry_b = (
            torch.zeros_like(ys[0]) if g is None else g for g in g_final
        )
        for t in range(ys.shape[0] - 1, -1, -1):
            g_s = carry_z if g_y is None else g_y[t] + carry_z
            g_v = carry_v if g_mem is None else g_mem[t] + carry_v
            g_u = slope[t] * g_s  # z' = threshold(u), u = v_d - b_d
            g_vd = g_v * keep_v[t] + g_u
            g_bd = carry_b - g_u
            g_jump[t] = carry_i  # i' = i_d + x W_in^T + z W_rec^T
            carry_z = carry_i @ w_rec
            carry_v = g_vd - g_vd * c_m  # v_d = v + c_m * ((v_leak - v) + i)
            carry_i = g_vd * c_m + (g_jump[t] + g_jump[t] * c_s)  # and i_d = i + c_s * i
            carry_b = g_bd - g_bd * c_a  # b_d = b + c_a * (v_th - b)
        return [carry_z, carry_v, carry_i, carry_b]


class NorseLSNNFeedForwardKernel(NorseFieldsKernel):
    """Norse's ``LSNNCell`` / ``LSNN`` step (``lsnn_feed_forward_step``) over a chunk: the
    state ``(v, i, b)``, the block's synaptic input ``x (k, B, ...)`` the current's jump (see
    the module docstring).

    Built as `NorseFieldsKernel` (``params``: the module's current ``LSNNParameters``).
    """

    #: the input current reaches the voltage a step later: the spikes of step 0 come from the
    #: initial state alone (`spikeckpt.engine.layerwise` runs T = 1 per step)
    input_delay = 1

    fields = FIELDS
    leaf_count = 3

    def fields_fit(self, p: Any, like: Tensor) -> bool:
        return _fixed_fields(p, like)

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
        p = self.p()
        c_m, c_s, c_a = _rates(p, self.dt)
        v, i, b = leaves
        k = z.shape[0]
        ys = v.new_empty((k, *v.shape))
        v_ds = v.new_empty((k, *v.shape)) if keep else None  # before the reset
        us = v.new_empty((k, *v.shape)) if keep else None  # v_d - b_d: the surrogate's input
        vs = v.new_empty((k, *v.shape)) if want_mem else None
        for t, x_t in enumerate(z.unbind(0)):
            v_d = v + c_m * ((p.v_leak - v) + i)
            i_d = i + c_s * i
            b_d = b + c_a * (p.v_th - b)
            u = v_d - b_d
            fired = norse_heaviside(u)
            v = (1 - fired) * v_d + fired * p.v_reset
            b = b_d + fired * p.beta
            i = i_d + x_t
            ys[t] = fired
            if v_ds is not None and us is not None:
                v_ds[t], us[t] = v_d, u
            if vs is not None:
                vs[t] = v
        saved = (v_ds, us, ys) if keep else None
        return [v, i, b], ys if want_y else None, vs, saved

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
        g_mem = per_leaf(g_mem, emit, 3, 0)[0]  # the membrane's
        v_ds, us, ys = saved  # (k, B, ...) each: v before the reset, v_d - b_d, the spikes
        p = self.p()
        c_m, c_s, c_a = _rates(p, self.dt)
        k = ys.shape[0]
        slope = surrogate_grad(
            self.spike, us, torch.zeros((), dtype=us.dtype), None, overwrite=consume
        )
        g_x = torch.empty_like(ys) if need_z else None  # dL/d i' per step
        carry_v, carry_i, carry_b = (torch.zeros_like(ys[0]) if g is None else g for g in g_final)
        for t in range(k - 1, -1, -1):
            g_v = carry_v if g_mem is None else g_mem[t] + carry_v
            s = ys[t]
            # v' = (1 - s) v_d + s v_reset, b' = b_d + s beta: the spike not detached
            g_s = g_v * (p.v_reset - v_ds[t]) + carry_b * p.beta
            if g_y is not None:
                g_s = g_s + g_y[t]
            g_u = slope[t] * g_s  # s = threshold(u), u = v_d - b_d
            g_vd = g_v * (1 - s) + g_u
            g_bd = carry_b - g_u
            if g_x is not None:
                g_x[t] = carry_i  # i' = i_d + x_t
            carry_i = g_vd * c_m + (carry_i + carry_i * c_s)  # v_d reads i; i_d = i + c_s i
            carry_v = g_vd - g_vd * c_m  # v_d = v + c_m * ((v_leak - v) + i)
            carry_b = g_bd - g_bd * c_a  # b_d = b + c_a * (v_th - b)
        return g_x, [carry_v, carry_i, carry_b], []
