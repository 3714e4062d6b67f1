"""The chunk kernel of Norse's exponential LIF neurons: ``LIFExCell`` / ``LIFEx``
(``lif_ex_feed_forward_step``) and ``LIFAdExCell`` / ``LIFAdEx``
(``lif_adex_feed_forward_step``, the membrane adapting), `NorseExKernel`.

Per step, as Norse writes it, from the state ``(v, i)`` (membrane, current; AdEx: ``(v, i,
a)``, ``a`` the adaptation current), the block's synaptic input ``x_t`` the current's jump::

    i_j = i + x_t
    e   = exp((v - v_th) / delta_T)
    v_d = v + dt * tau_mem_inv * (((v_leak - v) + delta_T * e) + i_j)      Ex
    v_d = v + dt * tau_mem_inv * ((((v_leak - v) + delta_T * e) + i_j) - a)  AdEx
    i'  = i_j + -dt * tau_syn_inv * i_j
    a_d = a + dt * tau_ada_inv * (adaptation_current * (v - v_leak) - a)   AdEx
    z'  = threshold(v_d - v_th)
    v'  = (1 - z') * v_d + z' * v_reset
    a'  = a_d + z' * adaptation_spike                                      AdEx

Norse detaches nothing here: the reset and the adaptation pass the spike's gradient through the
surrogate too. The forward runs these same operations in the same order (spikes, membranes and
states bitwise Norse's); the backward runs the adjoint recurrence by hand, the surrogate's
slope from Norse's own ``threshold`` once per chunk. Where ``v_d`` overflows (a membrane
starting high, a huge input), Norse's reset makes ``0 * inf = nan``, and so does the kernel's,
at the same places (its gradients too).

A field of the parameters that takes a gradient (made learnable by the user) keeps Norse's
per-step call: `NorseExKernel.accepts` declines it (the kernel returns no parameter
gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from spikeckpt.adapters.kernels import (
    NorseFieldsKernel,
    field_fits,
    per_leaf,
    surrogate_grad,
)
from spikeckpt.engine.fused import Emit, EmittedGrad

__all__ = ["NorseExKernel", "ex_fields_fit", "ex_rates", "exp_slope_less_one"]

#: the fields of ``LIFExParameters`` the step reads
EX_FIELDS = ("delta_T", "tau_syn_inv", "tau_mem_inv", "v_leak", "v_th", "v_reset")
#: those of ``LIFAdExParameters``
ADEX_FIELDS = (*EX_FIELDS, "adaptation_current", "adaptation_spike", "tau_ada_inv")


def ex_fields_fit(p: Any, fields: Sequence[str], like: Tensor) -> bool:
    """Whether every field of ``p`` in ``fields`` fits ``like`` (`field_fits`: none takes a
    gradient) and ``alpha`` takes none."""
    alpha = getattr(p, "alpha", None)
    return all(field_fits(getattr(p, f, None), like) for f in fields) and not (
        isinstance(alpha, Tensor) and alpha.requires_grad
    )


def ex_rates(p: Any, dt: float, adaptive: bool) -> tuple[Any, Any, Any]:
    """``(dt * tau_mem_inv, -dt * tau_syn_inv, dt * tau_ada_inv or None)``: the products
    Norse's steps form first (the same values)."""
    return dt * p.tau_mem_inv, -dt * p.tau_syn_inv, dt * p.tau_ada_inv if adaptive else None


def exp_slope_less_one(p: Any, v_ds: Tensor, ys: Tensor, v0: Tensor) -> Tensor:
    """``exp((v - v_th) / delta_T) - 1 (k, B, ...)`` at the membrane ``v`` entering each step,
    recomputed as the forward computed it (bitwise) from the membranes before the reset
    ``v_ds``, the spikes ``ys`` and ``v0 (B, ...)`` entering the chunk: d v_d / d v is ``1 +
    c_m`` times it (the exponential's slope less the leak's)."""
    v_in = torch.empty_like(v_ds)
    v_in[0] = v0
    if ys.shape[0] > 1:
        torch.add((1 - ys[:-1]) * v_ds[:-1], ys[:-1] * p.v_reset, out=v_in[1:])
    return torch.exp((v_in - p.v_th) / p.delta_T).sub_(1)


class NorseExKernel(NorseFieldsKernel):
    """Norse's ``lif_ex_feed_forward_step`` (``adaptive=False``, state ``(v, i)``) or
    ``lif_adex_feed_forward_step`` (``adaptive=True``, state ``(v, i, a)``) over a chunk; the
    block's synaptic input ``x (k, B, ...)`` is the current's jump (see the module
    docstring).

    Args:
        params: ``() -> p``, the module's current ``LIFExParameters`` / ``LIFAdExParameters``.
        dt: its time step.
        spike: ``u -> threshold(u, method, alpha)``.
        adaptive: the AdEx step.
        usable: ``() -> bool``, whether the module still has the step the kernel computes.
    """

    def __init__(
        self,
        params: Callable[[], Any],
        dt: float,
        spike: Callable[[Tensor], Tensor],
        adaptive: bool,
        usable: Callable[[], bool] = lambda: True,
    ) -> None:
        super().__init__(params, dt, spike, usable)
        self.fields, self.leaf_count = (ADEX_FIELDS, 3) if adaptive else (EX_FIELDS, 2)
        self.adaptive = adaptive

    def fields_fit(self, p: Any, like: Tensor) -> bool:
        return ex_fields_fit(p, self.fields, like)

    def _rates(self, p: Any) -> tuple[Any, Any, Any]:
        """`ex_rates` of ``p``."""
        return ex_rates(p, self.dt, self.adaptive)

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
        c_m, c_s, c_a = self._rates(p)
        v, i = leaves[0], leaves[1]
        a = leaves[2] if self.adaptive else None
        v0 = v
        k = z.shape[0]
        ys = v.new_empty((k, *v.shape))
        v_ds = v.new_empty((k, *v.shape)) if keep else None  # v before the reset
        vs = v.new_empty((k, *v.shape)) if want_mem else None
        zero = torch.as_tensor(0.0)  # Norse's heaviside: gt(u, 0) in u's dtype
        for t, x_t in enumerate(z.unbind(0)):
            i_j = i + x_t
            dv_leak = p.v_leak - v
            dv_exp = p.delta_T * torch.exp((v - p.v_th) / p.delta_T)
            if a is None:
                dv = c_m * (dv_leak + dv_exp + i_j)
            else:
                dv = c_m * (dv_leak + dv_exp + i_j - a)
                a = a + c_a * (p.adaptation_current * (v - p.v_leak) - a)
            v_d = v + dv if v_ds is None else torch.add(v, dv, out=v_ds[t])
            i = i_j + c_s * i_j
            s = torch.gt(v_d - p.v_th, zero, out=ys[t])
            kept, reset = (1 - s) * v_d, s * p.v_reset
            v = kept + reset if vs is None else torch.add(kept, reset, out=vs[t])
            if a is not None:
                a = a + s * p.adaptation_spike
        if vs is not None:
            v = v.clone()  # not a view of the membranes returned beside it
        saved = (v_ds, ys, v0) if keep else None
        final = [v, i] if a is None else [v, i, a]
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
        n = 3 if self.adaptive else 2
        g_mem = per_leaf(g_mem, emit, n, 0)[0]  # the membrane's
        # (k, B, ...) v before the reset and the spikes; (B, ...) v entering the chunk
        v_ds, ys, v0 = saved
        p = self.p()
        c_m, c_s, c_a = self._rates(p)
        k = ys.shape[0]
        keep_v = 1 - ys  # d v' / d v_d
        # d v_d / d v = 1 + c_m * (e - 1): the exponential's slope less the leak's
        e_less_1 = exp_slope_less_one(p, v_ds, ys, v0)
        slope = surrogate_grad(self.spike, v_ds, p.v_th, None)
        # d v' / d s = v_reset - v_d (in place on the saved tensor at the last backward)
        drop = v_ds.neg_().add_(p.v_reset) if consume else p.v_reset - v_ds
        g_x = torch.empty_like(ys) if need_z else None  # dL/d i_j per step
        carry = [torch.zeros_like(ys[0]) if g is None else g for g in g_final]
        carry_v, carry_i = carry[0], carry[1]
        carry_a = carry[2] if self.adaptive else None
        for t in range(k - 1, -1, -1):
            g_v = carry_v if g_mem is None else g_mem[t] + carry_v
            # v' = (1 - s) v_d + s v_reset (a' = a_d + s adaptation_spike): s not detached
            g_s = g_v * drop[t]
            if carry_a is not None:
                g_s = g_s + carry_a * p.adaptation_spike
            if g_y is not None:
                g_s = g_s + g_y[t]
            g_vd = g_v * keep_v[t] + slope[t] * g_s  # s = threshold(v_d - v_th)
            g_sum = g_vd * c_m  # v_d = v + c_m * sum
            g_id = carry_i + carry_i * c_s  # i' = i_j + c_s i_j
            # the sum reads i_j; i_j = i + x_t
            carry_i = g_sum + g_id if g_x is None else torch.add(g_sum, g_id, out=g_x[t])
            carry_v = g_vd + g_sum * e_less_1[t]  # the sum reads v: v_leak - v, delta_T * e
            if carry_a is not None:
                g_in = carry_a * c_a  # a_d = a + c_a * (adaptation_current (v - v_leak) - a)
                carry_v = carry_v + g_in * p.adaptation_current
                carry_a = (carry_a - g_in) - g_sum  # and the sum's - a
        if g_x is not None and k:
            carry_i = carry_i.clone()  # not a view of the input's gradient
        finals: list[Tensor | None] = [carry_v, carry_i]
        if carry_a is not None:
            finals.append(carry_a)
        return g_x, finals, []
