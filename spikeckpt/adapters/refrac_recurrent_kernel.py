"""The chunk kernel of Norse's recurrent cells with an absolute refractory period:
``LIFRefracRecurrentCell`` (``lif_refrac_step``) and ``LIFAdExRefracRecurrentCell``
(``lif_adex_refrac_step``, the membrane adapting), `NorseRefracRecurrentKernel`: the input
and recurrent weights inside the cell.

Norse's state is nested, ``LIFRefracState(LIFState(z, v, i), rho)`` (AdEx:
``LIFAdExRefracState(LIFAdExState(z, v, i, a), rho)``): the engine flattens it to the
leaves ``(z, v, i, rho)`` (``(z, v, i, a, rho)``). Per step, as Norse writes it
(``lif_step`` / ``lif_adex_step``, then ``compute_refractory_update``), with ``q = p.lif``
(``p.lif_adex``) and the block's input ``x_t``::

    i_j  = i + x_t W_in^T + z W_rec^T
    v_d  = v + dt * q.tau_mem_inv * ((q.v_leak - v) + i_j)                        LIF
    v_d  = v + dt * q.tau_mem_inv * ((((q.v_leak - v) + q.delta_T * e) + i_j) - a)  AdEx
    i'   = i_j + -dt * q.tau_syn_inv * i_j
    a_d  = a + dt * q.tau_ada_inv * (q.adaptation_current * (v - q.v_leak) - a)   AdEx
    s    = threshold(v_d - q.v_th)
    v_n  = (1 - s) * v_d + s * q.v_reset           LIF: s detached here (lif_step's)
    a'   = a_d + s * q.adaptation_spike            AdEx: the spike before the mask
    m    = threshold(rho)
    v'   = (1 - m) * v_n + m * v
    z'   = (1 - m) * s                             the output, fed back at the next step
    rho' = (1 - z') * relu(rho - m) + z' * p.rho_reset

with ``e = exp((v - q.v_th) / q.delta_T)``: the refractory update of
`spikeckpt.adapters.adex_refrac_kernel` on the recurrent steps of
`spikeckpt.adapters.recurrent_kernel` (LIF) and `spikeckpt.adapters.ex_recurrent_kernel`
(AdEx). The forward runs Norse's operations in Norse's order (spikes, membranes and states
bitwise); the backward runs the adjoint recurrence by hand, both surrogates' slopes from
Norse's own ``threshold`` once per chunk. The recurrent product stays one per step; the
input's is gathered over a sparse chunk where it may be (`InputGather`); the weights'
gradients are one product each per chunk. A field of the parameters that takes a gradient
keeps Norse's per-step call (`NorseRefracRecurrentKernel.accepts` declines it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from spikeckpt.adapters.adex_kernel import ADEX_FIELDS, ex_fields_fit, ex_rates
from spikeckpt.adapters.adex_refrac_kernel import entering, refractory_terms
from spikeckpt.adapters.kernels import _aligned, _wanted, field_fits, norse_heaviside, per_leaf
from spikeckpt.adapters.recurrent_kernel import NorseCellKernel, cell_fits, fed_back_grad
from spikeckpt.adapters.refrac_kernel import LIF_FIELDS
from spikeckpt.engine.fused import Emit, EmittedGrad

__all__ = ["NorseRefracRecurrentKernel"]


class NorseRefracRecurrentKernel(NorseCellKernel):
    """Norse's ``lif_refrac_step`` (``adaptive=False``, state ``(z, v, i, rho)``) or
    ``lif_adex_refrac_step`` (``adaptive=True``, state ``(z, v, i, a, rho)``) over a chunk
    ``x (k, B, n_in)`` (see the module docstring; ``tensors``: ``() -> (p, W_in, W_rec)``
    with ``p`` the cell's ``LIFRefracParameters`` / ``LIFAdExRefracParameters``; the other
    arguments as `NorseCellKernel`'s)."""

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
        self.leaf_count = 5 if adaptive else 4
        #: the fields of ``p``'s neuron parameters the step reads, and that field's name
        self.fields: tuple[str, ...] = ADEX_FIELDS if adaptive else LIF_FIELDS
        self.inner = "lif_adex" if adaptive else "lif"

    @property
    def params(self) -> tuple[Tensor, ...]:
        _, w_in, w_rec = self.tensors()
        return (w_in, w_rec)

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        if len(leaves) != self.leaf_count or not self.usable() or z.dim() != 3:
            return False
        p, w_in, w_rec = self.tensors()
        q = getattr(p, self.inner, None)
        return (
            ex_fields_fit(q, self.fields, z)
            and field_fits(getattr(p, "rho_reset", None), z)
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
        q = getattr(p, self.inner)
        c_m, c_s, c_a = ex_rates(q, self.dt, self.adaptive)
        spk0, v, i, *rest = leaves
        a, rho = rest if self.adaptive else (None, rest[0])
        v0, rho0 = v, rho
        shape = (z.shape[0], *v.shape)
        ys = v.new_empty(shape)
        v_ds = v.new_empty(shape) if keep else None  # v before the reset
        # the membranes and counters after each step (the backward's states entering a step)
        vs = v.new_empty(shape) if want_mem or keep else None
        rhos = v.new_empty(shape) if keep else None
        spk = spk0.clone()  # (a view of a stored state may sit at another alignment)
        current, held = self.inputs.current(z, w_in)
        for t, x_t in enumerate(z.unbind(0)):
            fed = F.linear(x_t, w_in) if current is None else current[t]
            i_j = i + fed + F.linear(spk, w_rec)
            if a is None:
                v_d = v + c_m * ((q.v_leak - v) + i_j)
            else:
                dv_exp = q.delta_T * torch.exp((v - q.v_th) / q.delta_T)
                v_d = v + c_m * ((q.v_leak - v) + dv_exp + i_j - a)
                a = a + c_a * (q.adaptation_current * (v - q.v_leak) - a)
            i = i_j + c_s * i_j
            s = norse_heaviside(v_d - q.v_th)
            v_n = (1 - s) * v_d + s * q.v_reset
            if a is not None:
                a = a + s * q.adaptation_spike
            m = norse_heaviside(rho)
            v = (1 - m) * v_n + m * v
            spk = (1 - m) * s
            rho = (1 - spk) * torch.relu(rho - m) + spk * p.rho_reset
            ys[t] = spk
            if v_ds is not None:
                v_ds[t] = v_d
            if vs is not None:
                vs[t] = v
            if rhos is not None:
                rhos[t] = rho
        saved = (v_ds, vs, rhos, ys, spk0, v0, rho0, *held) if keep else None
        final = [spk, v, i, rho] if a is None else [spk, v, i, a, rho]
        return final, ys if want_y else None, vs if want_mem else None, saved

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
        g_mem = per_leaf(g_mem, emit, self.leaf_count, 1)[1]  # the membrane's
        # (k, B, H) v before the reset, v, rho and the spikes after each step; (B, H) the
        # spikes, v and rho entering the chunk; what `InputGather.current` keeps
        v_ds, vs, rhos, ys, spk0, v0, rho0, *held = saved
        p, w_in, w_rec = self.tensors()
        q = getattr(p, self.inner)
        tensors = [w_in, w_rec]
        want = _wanted(tensors, need_params)
        c_m, c_s, c_a = ex_rates(q, self.dt, self.adaptive)
        v_in = entering(v0, vs)
        # AdEx: d v_d / d v = 1 + c_m * (e - 1), the exponential's slope less the leak's
        e_less_1 = torch.exp((v_in - q.v_th) / q.delta_T).sub_(1) if self.adaptive else None
        terms = refractory_terms(
            self.spike, v_ds, v_in, entering(rho0, rhos), q, p.rho_reset, not self.adaptive
        )
        del v_in
        # a' = a_d + s adaptation_spike: the spike before the mask
        by_a = terms.slope * q.adaptation_spike if self.adaptive else None
        g_jump = torch.empty_like(ys)  # dL/d i_j per step: the products' outputs
        carry = [torch.zeros_like(ys[0]) if g is None else g for g in g_final]
        carry_z, carry_v, carry_i, *rest = carry
        carry_a, carry_rho = rest if self.adaptive else (None, rest[0])
        for t in range(ys.shape[0] - 1, -1, -1):
            g_v = carry_v if g_mem is None else g_mem[t] + carry_v
            # z' feeds the output, the next step's product and the counter
            g_fired = carry_z + carry_rho * terms.jump[t]
            if g_y is not None:
                g_fired = g_fired + g_y[t]
            g_vd = g_v * terms.by_v[t] + g_fired * terms.by_fired[t]
            if carry_a is not None:
                g_vd = g_vd + carry_a * by_a[t]  # type: ignore[index]
            g_sum = g_vd * c_m  # v_d = v + c_m * sum
            # the sum reads i_j; i' = i_j + c_s i_j; i_j = i + x W_in^T + z W_rec^T
            carry_i = torch.add(g_sum, carry_i + carry_i * c_s, out=g_jump[t])
            carry_z = carry_i @ w_rec
            carry_v = g_vd - g_sum  # the sum's v_leak - v
            if carry_a is not None:
                g_in = carry_a * c_a  # a_d = a + c_a * (adaptation_current (v - v_leak) - a)
                carry_v = g_vd + g_sum * e_less_1[t] + g_in * q.adaptation_current  # type: ignore[index]
                carry_a = (carry_a - g_in) - g_sum  # and the sum's - a
            carry_v = carry_v + g_v * terms.masks[t]  # v' holds v
            carry_rho = carry_rho * terms.rho_keep[t] + g_v * terms.rho_by_v[t]
            carry_rho = carry_rho + g_fired * terms.rho_by_fired[t]
        del terms, by_a, e_less_1
        grads: list[Tensor | None] = [None, None]
        if want[0]:
            grads[0] = self.inputs.weight_grad(g_jump, (held[0], held[1], held[2]), w_in)
        if want[1]:
            grads[1] = fed_back_grad(g_jump, spk0.to(ys.dtype), ys)
        g_x = (g_jump @ w_in) if need_z else None
        finals: list[Tensor | None] = [carry_z, carry_v, carry_i.clone()]
        if carry_a is not None:
            finals.append(carry_a)
        finals.append(carry_rho)
        return g_x, finals, _aligned(tensors, grads, need_params)
