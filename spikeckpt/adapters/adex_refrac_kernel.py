"""The chunk kernel of Norse's adaptive exponential LIF neuron with an absolute refractory
period: ``LIFAdExRefracCell`` (``lif_adex_refrac_feed_forward_step``),
`NorseAdExRefracKernel`, and the refractory update's backward coefficients the refractory
kernels share (`refractory_terms`).

Norse's state is nested, ``LIFAdExRefracFeedForwardState(LIFAdExFeedForwardState(v, i, a),
rho)``: the engine flattens it to the leaves ``(v, i, a, rho)`` (membrane, current,
adaptation current, refractory counter). Per step, as Norse writes it
(``lif_adex_feed_forward_step``, then ``compute_refractory_update``), with ``q = p.lif_adex``
and the block's synaptic input ``x_t`` the current's jump::

    i_j  = i + x_t
    e    = exp((v - q.v_th) / q.delta_T)
    v_d  = v + dt * q.tau_mem_inv * ((((q.v_leak - v) + q.delta_T * e) + i_j) - a)
    i'   = i_j + -dt * q.tau_syn_inv * i_j
    a_d  = a + dt * q.tau_ada_inv * (q.adaptation_current * (v - q.v_leak) - a)
    z    = threshold(v_d - q.v_th)
    v_n  = (1 - z) * v_d + z * q.v_reset
    a'   = a_d + z * q.adaptation_spike           the spike before the mask
    m    = threshold(rho)                         refractory: the spike and the update held
    v'   = (1 - m) * v_n + m * v
    z'   = (1 - m) * z
    rho' = (1 - z') * relu(rho - m) + z' * p.rho_reset

Norse detaches nothing here: the reset, the adaptation and the counter pass the spike's
gradient through the surrogate, the mask passes the counter's (``threshold(rho)``, the same
``method`` and ``alpha``). The forward runs these same operations in the same order (spikes,
membranes and states bitwise Norse's); the backward runs the adjoint recurrence by hand,
both surrogates' slopes from Norse's own ``threshold`` once per chunk. A field of the
parameters that takes a gradient keeps Norse's per-step call (`NorseAdExRefracKernel.accepts`
declines it: the kernel returns no parameter gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from spikeckpt.adapters.adex_kernel import ADEX_FIELDS, ex_fields_fit, ex_rates
from spikeckpt.adapters.kernels import NorseFieldsKernel, field_fits, per_leaf, surrogate_grad
from spikeckpt.engine.fused import Emit, EmittedGrad

__all__ = ["NorseAdExRefracKernel", "RefractoryTerms", "refractory_terms"]


class RefractoryTerms(NamedTuple):
    """The backward's per-step coefficients of the refractory update, ``(k, B, ...)`` each
    (notation of the module docstring; ``g_z'`` is dL/d z', every path)::

        dL/d v_d = g_v' * by_v + g_z' * by_fired (+ what the step's other uses of z add,
                   times slope)
        dL/d v  += g_v' * masks                  (v' = (1 - m) v_n + m v)
        dL/d rho = g_rho' * rho_keep + g_v' * rho_by_v + g_z' * rho_by_fired
        dL/d z' += g_rho' * jump                 (the counter's)
    """

    masks: Tensor  # m
    slope: Tensor  # d z / d v_d: the surrogate's slope
    by_v: Tensor
    by_fired: Tensor
    jump: Tensor
    rho_keep: Tensor
    rho_by_v: Tensor
    rho_by_fired: Tensor


def refractory_terms(
    spike: Callable[[Tensor], Tensor],
    v_ds: Tensor,
    v_in: Tensor,
    rho_in: Tensor,
    q: Any,
    rho_reset: Any,
    detached_reset: bool = False,
) -> RefractoryTerms:
    """The refractory update's coefficients over a chunk from the membranes before the reset
    ``v_ds``, the membranes and counters entering each step ``v_in``, ``rho_in`` (``(k, B,
    ...)`` each; ``rho_in`` is overwritten), the neuron's parameters ``q`` (``v_th``,
    ``v_reset``) and ``rho_reset``; ``detached_reset``: the reset takes no gradient through
    the spike (``lif_step``'s ``z.detach()``)."""
    zero = torch.as_tensor(0.0)  # Norse's heaviside: gt(x, 0) in x's dtype
    masks = torch.gt(rho_in, zero).to(v_ds.dtype)
    slope_rho = surrogate_grad(spike, rho_in, zero, None)
    slope = surrogate_grad(spike, v_ds, q.v_th, None)
    spikes = torch.gt(v_ds - q.v_th, zero).to(v_ds.dtype)  # z, before the mask
    open_ = 1 - masks
    # rho' = (1 - z') relu(rho - m) + z' rho_reset, z' = (1 - m) z
    gap = rho_in.sub_(masks)
    through = (1 - open_ * spikes).mul_(gap > 0)  # d rho' / d rho through relu
    jump = torch.relu_(gap).neg_().add_(rho_reset)  # d rho' / d z'
    del gap
    kept = 1 - spikes
    # v' = (1 - m) v_n + m v, v_n = (1 - z) v_d + z v_reset: d v' / d m = v - v_n
    hold = v_in - (kept * v_ds + spikes * q.v_reset)
    by_fired = slope * open_
    if detached_reset:
        by_v = kept.mul_(open_)
    else:  # d v_n / d v_d = (1 - z) + (v_reset - v_d) slope
        by_v = (q.v_reset - v_ds).mul_(slope).add_(kept).mul_(open_)
    # m = threshold(rho): dL/d m = g_v' hold - g_z' z - g_rho' (1 - z') [rho - m > 0]
    rho_keep = through.mul_(1 - slope_rho)
    rho_by_v = hold.mul_(slope_rho)
    rho_by_fired = spikes.mul_(slope_rho).neg_()
    return RefractoryTerms(masks, slope, by_v, by_fired, jump, rho_keep, rho_by_v, rho_by_fired)


def entering(first: Tensor, after: Tensor) -> Tensor:
    """The values entering each step ``(k, B, ...)``: ``first (B, ...)``, then ``after``'s
    (the values after each step) but the last."""
    return torch.cat([first[None], after[:-1]])


class NorseAdExRefracKernel(NorseFieldsKernel):
    """Norse's ``lif_adex_refrac_feed_forward_step`` over a chunk (state leaves ``(v, i, a,
    rho)``); the block's synaptic input ``x (k, B, ...)`` is the current's jump (see the
    module docstring).

    Built as `NorseFieldsKernel` (``params``: the module's current
    ``LIFAdExRefracParameters``; ``spike``: ``u -> threshold(u, p.lif_adex.method,
    p.lif_adex.alpha)``).
    """

    fields = ADEX_FIELDS
    leaf_count = 4

    def fields_fit(self, p: Any, like: Tensor) -> bool:
        q = getattr(p, "lif_adex", None)
        return ex_fields_fit(q, self.fields, like) and field_fits(
            getattr(p, "rho_reset", None), like
        )

    @property
    def params(self) -> tuple[Tensor, ...]:
        """The fields that are tensors, none taking a gradient when the kernel runs."""
        p = self.p()
        found = [getattr(p.lif_adex, f, None) for f in self.fields] + [p.rho_reset]
        return tuple(t for t in found if isinstance(t, Tensor))

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
        q = p.lif_adex
        c_m, c_s, c_a = ex_rates(q, self.dt, True)
        v, i, a, rho = leaves
        v0, rho0 = v, rho
        shape = (z.shape[0], *v.shape)
        ys = v.new_empty(shape)
        v_ds = v.new_empty(shape) if keep else None  # v before the reset
        # the membranes and counters after each step (the backward's states entering a step)
        vs = v.new_empty(shape) if want_mem or keep else None
        rhos = v.new_empty(shape) if keep else None
        zero = torch.as_tensor(0.0)  # Norse's heaviside: gt(x, 0) in x's dtype
        s, m = torch.empty_like(v), torch.empty_like(v)  # this step's spike and mask
        for t, x_t in enumerate(z.unbind(0)):
            i_j = i + x_t
            dv_leak = q.v_leak - v
            dv_exp = q.delta_T * torch.exp((v - q.v_th) / q.delta_T)
            dv = c_m * (dv_leak + dv_exp + i_j - a)
            v_d = v + dv if v_ds is None else torch.add(v, dv, out=v_ds[t])
            i = i_j + c_s * i_j
            a = a + c_a * (q.adaptation_current * (v - q.v_leak) - a)
            torch.gt(v_d - q.v_th, zero, out=s)
            v_n = (1 - s) * v_d + s * q.v_reset
            a = a + s * q.adaptation_spike
            torch.gt(rho, zero, out=m)
            open_ = 1 - m
            held, kept = open_ * v_n, m * v
            v = held + kept if vs is None else torch.add(held, kept, out=vs[t])
            fired = torch.mul(open_, s, out=ys[t])
            rho_d, jump = (1 - fired) * torch.relu(rho - m), fired * p.rho_reset
            rho = rho_d + jump if rhos is None else torch.add(rho_d, jump, out=rhos[t])
        if vs is not None:
            v = v.clone()  # not a view of the membranes returned beside it (or kept)
        if rhos is not None:
            rho = rho.clone()
        saved = (v_ds, vs, rhos, v0, rho0) if keep else None
        return [v, i, a, rho], ys if want_y else None, vs if want_mem else None, saved

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
        g_mem = per_leaf(g_mem, emit, 4, 0)[0]  # the membrane's
        # (k, B, ...) v before the reset, v and rho after each step; (B, ...) v, rho entering
        v_ds, vs, rhos, v0, rho0 = saved
        p = self.p()
        q = p.lif_adex
        c_m, c_s, c_a = ex_rates(q, self.dt, True)
        v_in = entering(v0, vs)
        # d v_d / d v = 1 + c_m * (e - 1): the exponential's slope less the leak's
        e_less_1 = torch.exp((v_in - q.v_th) / q.delta_T).sub_(1)
        terms = refractory_terms(self.spike, v_ds, v_in, entering(rho0, rhos), q, p.rho_reset)
        del v_in
        # a' = a_d + z adaptation_spike: the spike before the mask
        by_a = terms.slope * q.adaptation_spike
        g_x = torch.empty_like(v_ds) if need_z else None  # dL/d i_j per step
        carry = [torch.zeros_like(v_ds[0]) if g is None else g for g in g_final]
        carry_v, carry_i, carry_a, carry_rho = carry
        for t in range(v_ds.shape[0] - 1, -1, -1):
            g_v = carry_v if g_mem is None else g_mem[t] + carry_v
            g_fired = carry_rho * terms.jump[t]
            if g_y is not None:
                g_fired = g_fired + g_y[t]
            g_vd = g_v * terms.by_v[t] + g_fired * terms.by_fired[t] + carry_a * by_a[t]
            g_sum = g_vd * c_m  # v_d = v + c_m * sum
            g_id = carry_i + carry_i * c_s  # i' = i_j + c_s i_j
            carry_i = g_sum + g_id if g_x is None else torch.add(g_sum, g_id, out=g_x[t])
            g_in = carry_a * c_a  # a_d = a + c_a * (adaptation_current (v - v_leak) - a)
            # the sum reads v (v_leak - v, delta_T * e), a_d reads it, v' holds it
            carry_v = g_vd + g_sum * e_less_1[t] + g_in * q.adaptation_current
            carry_v = carry_v + g_v * terms.masks[t]
            carry_a = (carry_a - g_in) - g_sum  # and the sum's - a
            carry_rho = carry_rho * terms.rho_keep[t] + g_v * terms.rho_by_v[t]
            carry_rho = carry_rho + g_fired * terms.rho_by_fired[t]
        if g_x is not None and v_ds.shape[0]:
            carry_i = carry_i.clone()  # not a view of the input's gradient
        return g_x, [carry_v, carry_i, carry_a, carry_rho], []
