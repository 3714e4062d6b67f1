"""The chunk kernel of Norse's LIF neuron with an absolute refractory period:
``LIFRefracCell`` (``lif_refrac_feed_forward_step``), `NorseRefracKernel`.

Norse's state is nested, ``LIFRefracFeedForwardState(LIFFeedForwardState(v, i), rho)``: the
engine flattens it to the leaves ``(v, i, rho)`` (membrane, current, refractory counter). Per
step, as Norse writes it (``lif_feed_forward_step``, then ``compute_refractory_update``), with
``q = p.lif`` and the block's synaptic input ``x_t`` the current's jump::

    i_j  = i + x_t
    v_d  = v + dt * q.tau_mem_inv * ((q.v_leak - v) + i_j)
    i'   = i_j + -dt * q.tau_syn_inv * i_j
    z    = threshold(v_d - q.v_th)
    v_n  = (1 - z) * v_d + z * q.v_reset
    m    = threshold(rho)                       refractory: the spike and the update held
    v'   = (1 - m) * v_n + m * v
    z'   = (1 - m) * z
    rho' = (1 - z') * relu(rho - m) + z' * p.rho_reset

Norse detaches nothing here: the mask ``m`` passes the counter's gradient through the
surrogate (``threshold(rho)``, the same ``method`` and ``alpha`` as the spike's), and the
counter's update passes the spike's. The forward runs these same operations in the same order
(spikes, membranes and states bitwise Norse's); the backward runs the adjoint recurrence by
hand, both surrogates' slopes from Norse's own ``threshold`` once per chunk.

A field of the parameters that takes a gradient (made learnable by the user) keeps Norse's
per-step call: `NorseRefracKernel.accepts` declines it (the kernel returns no parameter
gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from spikeckpt.adapters.izhikevich_kernel import as_host_scalar
from spikeckpt.adapters.kernels import NorseFieldsKernel, field_fits, per_leaf, surrogate_grad
from spikeckpt.engine.fused import Emit, EmittedGrad

__all__ = ["NorseRefracKernel"]

#: the fields of ``LIFRefracParameters.lif`` (``LIFParameters``) the step reads
LIF_FIELDS = ("tau_syn_inv", "tau_mem_inv", "v_leak", "v_th", "v_reset")


class NorseRefracKernel(NorseFieldsKernel):
    """Norse's ``lif_refrac_feed_forward_step`` over a chunk (state leaves ``(v, i, rho)``);
    the block's synaptic input ``x (k, B, ...)`` is the current's jump (see the module
    docstring).

    Built as `NorseFieldsKernel` (``params``: the module's current ``LIFRefracParameters``;
    ``spike``: ``u -> threshold(u, p.lif.method, p.lif.alpha)``).
    """

    fields = LIF_FIELDS
    leaf_count = 3

    def _fields(self, p: Any) -> list[Any]:
        """The fields the step reads: ``p.lif``'s, then ``p.rho_reset``."""
        lif = getattr(p, "lif", None)
        return [getattr(lif, f, None) for f in self.fields] + [getattr(p, "rho_reset", None)]

    def fields_fit(self, p: Any, like: Tensor) -> bool:
        alpha = getattr(getattr(p, "lif", None), "alpha", None)
        return all(field_fits(f, like) for f in self._fields(p)) and not (
            isinstance(alpha, Tensor) and alpha.requires_grad
        )

    @property
    def params(self) -> tuple[Tensor, ...]:
        """The fields that are tensors, none taking a gradient when the kernel runs."""
        return tuple(t for t in self._fields(self.p()) if isinstance(t, Tensor))

    def _rates(self, q: Any) -> tuple[Any, Any]:
        """``(dt * tau_mem_inv, -dt * tau_syn_inv)``: the products Norse's step forms first
        (the same values)."""
        return self.dt * q.tau_mem_inv, -self.dt * q.tau_syn_inv

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
        q = p.lif
        c_m, c_s = self._rates(q)
        v, i, rho = leaves
        v0, rho0 = v, rho
        k = z.shape[0]
        shape = (k, *v.shape)
        ys = v.new_empty(shape)
        v_ds = v.new_empty(shape) if keep else None  # v before the reset
        # the membranes and counters after each step (the backward's states entering a step)
        vs = v.new_empty(shape) if want_mem or keep else None
        rhos = v.new_empty(shape) if keep else None
        c_m, c_s = (as_host_scalar(r, v) for r in (c_m, c_s))
        v_leak, v_th, v_reset, rho_reset = (
            as_host_scalar(f, v) for f in (q.v_leak, q.v_th, q.v_reset, p.rho_reset)
        )
        zero = torch.as_tensor(0.0)  # Norse's heaviside: gt(x, 0) in x's dtype
        one = torch.ones((), dtype=v.dtype)
        s, m = torch.empty_like(v), torch.empty_like(v)  # this step's spike and mask
        for t, x_t in enumerate(z.unbind(0)):
            i_j = i + x_t
            dv = c_m * ((v_leak - v) + i_j)
            v_d = v + dv if v_ds is None else torch.add(v, dv, out=v_ds[t])
            i = i_j + c_s * i_j
            torch.gt(v_d - v_th, zero, out=s)
            v_n = torch.sub(one, s) * v_d + s * v_reset
            torch.gt(rho, zero, out=m)
            open_ = torch.sub(one, m)  # 1 - m
            held, kept = open_ * v_n, m * v
            v = held + kept if vs is None else torch.add(held, kept, out=vs[t])
            fired = torch.mul(open_, s, out=ys[t])
            rho_d, jump = torch.sub(one, fired) * torch.relu(rho - m), fired * rho_reset
            rho = rho_d + jump if rhos is None else torch.add(rho_d, jump, out=rhos[t])
        if vs is not None:
            v = v.clone()  # not a view of the membranes returned beside it (or kept)
        if rhos is not None:
            rho = rho.clone()
        saved = (v_ds, vs, rhos, v0, rho0) if keep else None
        return [v, i, rho], ys if want_y else None, vs if want_mem else None, saved

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
        # (k, B, ...) v before the reset, v and rho after each step; (B, ...) v, rho entering
        v_ds, vs, rhos, v0, rho0 = saved
        p = self.p()
        q = p.lif
        c_m, c_s = self._rates(q)
        k = v_ds.shape[0]
        like = {"dtype": v_ds.dtype, "device": v_ds.device}
        zero = torch.as_tensor(0.0)
        rho_in = torch.cat([rho0[None], rhos[:-1]])  # rho entering each step
        masks = torch.gt(rho_in, zero).to(v_ds.dtype)  # m
        slope_rho = surrogate_grad(self.spike, rho_in, zero, None)
        slope = surrogate_grad(self.spike, v_ds, q.v_th, None)
        spikes = torch.gt(v_ds - q.v_th, zero).to(v_ds.dtype)  # z, before the mask
        open_ = 1 - masks
        # rho' = (1 - z') relu(rho - m) + z' rho_reset, z' = (1 - m) z
        gap = rho_in.sub_(masks)
        through = (1 - open_ * spikes).mul_(gap > 0)  # d rho' / d rho through relu
        jump = torch.relu_(gap).neg_().add_(p.rho_reset)  # d rho' / d z'
        del gap, rho_in
        # v' = (1 - m) v_n + m v, v_n = (1 - z) v_d + z v_reset: d v' / d m = v - v_n
        hold = torch.cat([v0[None], vs[:-1]]).sub_((1 - spikes) * v_ds + spikes * q.v_reset)
        # dL/d v_d = g_v by_v + g_z' by_fired (z = threshold(v_d - v_th))
        by_fired = slope * open_
        by_v = v_ds.neg_() if consume else v_ds.neg()
        by_v = by_v.add_(q.v_reset).mul_(slope).add_(1 - spikes).mul_(open_)
        del slope
        # m = threshold(rho): rho's carry gets slope_rho dL/d m, dL/d m = g_v hold - g_z'
        # z - g_relu
        rho_keep = through.mul_(1 - slope_rho)
        rho_by_v = hold.mul_(slope_rho)
        rho_by_fired = spikes.mul_(slope_rho).neg_()
        del slope_rho, open_
        i_keep = 1 + torch.as_tensor(c_s, **like)  # i' = i_j + c_s i_j (in the state's dtype)
        g_x = torch.empty_like(v_ds) if need_z else None  # dL/d i_j per step
        carry = [torch.zeros_like(v_ds[0]) if g is None else g for g in g_final]
        carry_v, carry_i, carry_rho = carry
        for t in range(k - 1, -1, -1):
            g_v = carry_v if g_mem is None else g_mem[t] + carry_v
            g_fired = (
                carry_rho * jump[t] if g_y is None else torch.addcmul(g_y[t], carry_rho, jump[t])
            )
            g_vd = torch.addcmul(g_v * by_v[t], g_fired, by_fired[t])
            g_ij = torch.add(g_vd * c_m, carry_i * i_keep, out=None if g_x is None else g_x[t])
            carry_i = g_ij
            carry_v = torch.addcmul(g_vd - g_vd * c_m, g_v, masks[t])
            carry_rho = torch.addcmul(carry_rho * rho_keep[t], g_v, rho_by_v[t])
            carry_rho = torch.addcmul(carry_rho, g_fired, rho_by_fired[t])
        if g_x is not None and k:
            carry_i = carry_i.clone()  # not a view of the input's gradient
        return g_x, [carry_v, carry_i, carry_rho], []
