"""The chunk kernel of Norse's recurrent exponential LIF cells: ``LIFExRecurrentCell``
(``lif_ex_step``) and ``LIFAdExRecurrentCell`` (``lif_adex_step``, the membrane adapting),
`NorseExRecurrentKernel`: the input and recurrent weights inside the cell.

Per step, as Norse writes it, from the state ``(z, v, i)`` (previous spikes, membrane,
current; AdEx: ``(z, v, i, a)``, ``a`` the adaptation current), the block's input ``x_t``::

    i_j = i + x_t W_in^T + z W_rec^T
    e   = exp((v - v_th) / delta_T)
    v_d = v + dt * tau_mem_inv * (((v_leak - v) + delta_T * e) + i_j)        Ex
    v_d = v + dt * tau_mem_inv * ((((v_leak - v) + delta_T * e) + i_j) - a)  AdEx
    i'  = i_j + -dt * tau_syn_inv * i_j
    a_d = a + dt * tau_ada_inv * (adaptation_current * (v - v_leak) - a)     AdEx
    z'  = threshold(v_d - v_th)
    v'  = (1 - z') * v_d + z' * v_reset
    a'  = a_d + z' * adaptation_spike                                        AdEx

the feed-forward step of `spikeckpt.adapters.adex_kernel` with the current's jump weighted
inside the cell and the previous spikes fed back. Norse detaches nothing: the spike's
gradient reaches the state through the reset, the adaptation and the next step's recurrent
product. The recurrent product stays one per step; the input's is gathered over a sparse
chunk where it may be (`InputGather`); the weights' gradients are one product each per
chunk. A field of the parameters that takes a gradient keeps Norse's per-step call
(`NorseExRecurrentKernel.accepts` declines it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from spikeckpt.adapters.adex_kernel import (
    ADEX_FIELDS,
    EX_FIELDS,
    ex_fields_fit,
    ex_rates,
    exp_slope_less_one,
)
from spikeckpt.adapters.kernels import _aligned, _wanted, norse_heaviside, per_leaf, surrogate_grad
from spikeckpt.adapters.recurrent_kernel import NorseCellKernel, cell_fits, fed_back_grad
from spikeckpt.engine.fused import Emit, EmittedGrad

__all__ = ["NorseExRecurrentKernel"]


class NorseExRecurrentKernel(NorseCellKernel):
    """Norse's ``lif_ex_step`` (``adaptive=False``, state ``(z, v, i)``) or ``lif_adex_step``
    (``adaptive=True``, state ``(z, v, i, a)``) over a chunk ``x (k, B, n_in)`` (see the
    module docstring; the other arguments as `NorseCellKernel`'s)."""

    def __init__(
        self,
        tensors: Callable[[], tuple[Any, Tensor, Tensor]],
        dt: float,
        spike: Callable[[Tensor], Tensor],
        adaptive: bool,
        usable: Callable[[], bool] = lambda: True,
    ) -> None:
        super().__init__(tensors, dt, spike, usable)
        self.adaptive = adaptive
        self.fields = ADEX_FIELDS if adaptive else EX_FIELDS

    @property
    def params(self) -> tuple[Tensor, ...]:
        _, w_in, w_rec = self.tensors()
        return (w_in, w_rec)

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        if len(leaves) != (4 if self.adaptive else 3) or not self.usable() or z.dim() != 3:
            return False
        p, w_in, w_rec = self.tensors()
        return ex_fields_fit(p, self.fields, z) and cell_fits(leaves, z, w_in, w_rec)

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
        c_m, c_s, c_a = ex_rates(p, self.dt, self.adaptive)
        spk0, v, i = leaves[0], leaves[1], leaves[2]
        a = leaves[3] if self.adaptive else None
        v0 = v
        k = z.shape[0]
        ys = v.new_empty((k, *v.shape))
        v_ds = v.new_empty((k, *v.shape)) if keep else None  # v before the reset
        vs = v.new_empty((k, *v.shape)) if want_mem else None
        spk = spk0.clone()  # (a view of a stored state may sit at another alignment)
        current, held = self.inputs.current(z, w_in)
        for t, x_t in enumerate(z.unbind(0)):
            fed = F.linear(x_t, w_in) if current is None else current[t]
            i_j = i + fed + F.linear(spk, w_rec)
            dv_leak = p.v_leak - v
            dv_exp = p.delta_T * torch.exp((v - p.v_th) / p.delta_T)
            if a is None:
                dv = c_m * (dv_leak + dv_exp + i_j)
            else:
                dv = c_m * (dv_leak + dv_exp + i_j - a)
                a = a + c_a * (p.adaptation_current * (v - p.v_leak) - a)
            v_d = v + dv
            i = i_j + c_s * i_j
            spk = norse_heaviside(v_d - p.v_th)
            v = (1 - spk) * v_d + spk * p.v_reset
            if a is not None:
                a = a + spk * p.adaptation_spike
            ys[t] = spk
            if v_ds is not None:
                v_ds[t] = v_d
            if vs is not None:
                vs[t] = v
        saved = (v_ds, ys, spk0, v0, *held) if keep else None
        final = [spk, v, i] if a is None else [spk, v, i, a]
        return final, ys if want_y else None, vs, saved

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
        n = 4 if self.adaptive else 3
        g_mem = per_leaf(g_mem, emit, n, 1)[1]  # the membrane's
        # (k, B, H) v before the reset and the spikes; (B, H) the spikes and v entering the
        # chunk; what `InputGather.current` keeps
        v_ds, ys, spk0, v0, *held = saved
        p, w_in, w_rec = self.tensors()
        tensors = [w_in, w_rec]
        want = _wanted(tensors, need_params)
        c_m, c_s, c_a = ex_rates(p, self.dt, self.adaptive)
        e_less_1 = exp_slope_less_one(p, v_ds, ys, v0)
        slope = surrogate_grad(self.spike, v_ds, p.v_th, None)
        keep_v = 1 - ys  # d v' / d v_d
        drop = p.v_reset - v_ds  # d v' / d z'
        g_jump = torch.empty_like(ys)  # dL/d i_j per step: the products' outputs
        carry = [torch.zeros_like(ys[0]) if g is None else g for g in g_final]
        carry_z, carry_v, carry_i = carry[0], carry[1], carry[2]
        carry_a = carry[3] if self.adaptive else None
        for t in range(ys.shape[0] - 1, -1, -1):
            g_v = carry_v if g_mem is None else g_mem[t] + carry_v
            # z' feeds the output, the next step's product, the reset and the adaptation
            g_s = carry_z + g_v * drop[t]
            if carry_a is not None:
                g_s = g_s + carry_a * p.adaptation_spike
            if g_y is not None:
                g_s = g_s + g_y[t]
            g_vd = g_v * keep_v[t] + slope[t] * g_s  # z' = threshold(v_d - v_th)
            g_sum = g_vd * c_m  # v_d = v + c_m * sum
            # the sum reads i_j; i' = i_j + c_s i_j; i_j = i + x W_in^T + z W_rec^T
            carry_i = torch.add(g_sum, carry_i + carry_i * c_s, out=g_jump[t])
            carry_z = carry_i @ w_rec
            carry_v = g_vd + g_sum * e_less_1[t]  # the sum reads v: v_leak - v, delta_T * e
            if carry_a is not None:
                g_in = carry_a * c_a  # a_d = a + c_a * (adaptation_current (v - v_leak) - a)
                carry_v = carry_v + g_in * p.adaptation_current
                carry_a = (carry_a - g_in) - g_sum  # and the sum's - a
        del slope, keep_v, drop, e_less_1
        grads: list[Tensor | None] = [None, None]
        if want[0]:
            grads[0] = self.inputs.weight_grad(g_jump, (held[0], held[1], held[2]), w_in)
        if want[1]:
            grads[1] = fed_back_grad(g_jump, spk0.to(ys.dtype), ys)
        g_x = (g_jump @ w_in) if need_z else None
        finals: list[Tensor | None] = [carry_z, carry_v, carry_i.clone()]
        if carry_a is not None:
            finals.append(carry_a)
        return g_x, finals, _aligned(tensors, grads, need_params)
