"""The chunk kernel of Norse's Izhikevich neuron: ``IzhikevichCell`` / ``Izhikevich``
(``izhikevich_feed_forward_step``), `NorseIzhikevichKernel`.

Per step, as Norse writes it, from the state ``(v, u)`` (membrane, recovery variable, mV), the
block's synaptic input ``x_t`` the input current::

    v_d = v + tau_inv * dt * ((((sq * v**2 + mn * v) + bias) - u) + x_t)
    u_d = u + tau_inv * dt * a * (b * v - u)
    z'  = threshold(v_d - v_th)
    v'  = (1 - z') * v_d + z' * c
    u'  = (1 - z') * u_d + z' * (u_d + d)

Norse detaches nothing: the resets of ``v`` and ``u`` pass the spike's gradient through the
surrogate too. The forward runs these same operations in the same order (spikes, membranes and
states bitwise Norse's); the backward runs the adjoint recurrence by hand, the surrogate's
slope from Norse's own ``threshold`` once per chunk. ``u`` enters every step linearly, so the
backward keeps only the membranes (``v`` before the reset, the spikes, ``v`` entering the
chunk).

The fields of ``IzhikevichParameters`` are Python numbers in Norse's presets (``tonic_spiking``,
...); a tensor field that takes a gradient (made learnable by the user) keeps Norse's per-step
call: `NorseIzhikevichKernel.accepts` declines it (the kernel returns no parameter gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from spikeckpt.adapters.kernels import NorseFieldsKernel, field_fits, per_leaf, surrogate_grad
from spikeckpt.engine.fused import Emit, EmittedGrad

__all__ = ["NorseIzhikevichKernel"]

#: the fields of ``IzhikevichParameters`` the step reads
IZHIKEVICH_FIELDS = ("a", "b", "c", "d", "sq", "mn", "bias", "v_th", "tau_inv")


def as_host_scalar(value: Any, like: Tensor) -> Any:
    """A Python number as a 0-d host tensor of ``like``'s dtype, else ``value`` itself: torch
    rounds a Python number to the tensor's dtype in an elementwise op, so the results are
    bitwise the same, and an op with a 0-d tensor skips the number's wrapping (about half
    the time of such an op on a CPU step of 8,192 neurons)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(value, dtype=like.dtype)
    return value


class NorseIzhikevichKernel(NorseFieldsKernel):
    """Norse's ``izhikevich_feed_forward_step`` over a chunk (state ``(v, u)``); the block's
    synaptic input ``x (k, B, ...)`` is the input current (see the module docstring).

    Built as `NorseFieldsKernel` (``params``: the module's current ``IzhikevichParameters``).
    """

    fields = IZHIKEVICH_FIELDS
    leaf_count = 2

    def fields_fit(self, p: Any, like: Tensor) -> bool:
        alpha = getattr(p, "alpha", None)
        return all(field_fits(getattr(p, f, None), like) for f in self.fields) and not (
            isinstance(alpha, Tensor) and alpha.requires_grad
        )

    def _rates(self, p: Any) -> tuple[Any, Any]:
        """``(tau_inv * dt, tau_inv * dt * a)``: the products Norse's step forms first (the
        same values)."""
        return p.tau_inv * self.dt, p.tau_inv * self.dt * p.a

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
        v, u = leaves[0], leaves[1]
        c_v, c_u = (as_host_scalar(r, v) for r in self._rates(p))
        sq, mn, bias, b, v_th, c, d = (
            as_host_scalar(getattr(p, f), v) for f in ("sq", "mn", "bias", "b", "v_th", "c", "d")
        )
        one = torch.ones((), dtype=v.dtype)
        v0 = v
        k = z.shape[0]
        ys = v.new_empty((k, *v.shape))
        v_ds = v.new_empty((k, *v.shape)) if keep else None  # v before the reset
        vs = v.new_empty((k, *v.shape)) if want_mem else None
        zero = torch.as_tensor(0.0)  # Norse's heaviside: gt(x, 0) in x's dtype
        for t, x_t in enumerate(z.unbind(0)):
            dv = c_v * (sq * v**2 + mn * v + bias - u + x_t)
            v_d = v + dv if v_ds is None else torch.add(v, dv, out=v_ds[t])
            u_d = u + c_u * (b * v - u)
            s = torch.gt(v_d - v_th, zero, out=ys[t])
            stay = torch.sub(one, s)  # 1 - s
            kept, reset = stay * v_d, s * c
            v = kept + reset if vs is None else torch.add(kept, reset, out=vs[t])
            u = stay * u_d + s * (u_d + d)
        if vs is not None:
            v = v.clone()  # not a view of the membranes returned beside it
        saved = (v_ds, ys, v0) if keep else None
        return [v, u], ys if want_y else None, vs, saved

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
        g_mem = per_leaf(g_mem, emit, 2, 0)[0]  # the membrane's
        # (k, B, ...) v before the reset and the spikes; (B, ...) v entering the chunk
        v_ds, ys, v0 = saved
        p = self.p()
        c_v, c_u = self._rates(p)
        k = ys.shape[0]
        # v entering each step, as the forward computed it (the same ops: bitwise)
        v_in = torch.empty_like(v_ds)
        v_in[0] = v0
        if k > 1:
            torch.add((1 - ys[:-1]) * v_ds[:-1], ys[:-1] * p.c, out=v_in[1:])
        # d (sq * v**2 + mn * v) / d v
        slope_in = v_in.mul_(2).mul_(p.sq).add_(p.mn)
        slope = surrogate_grad(self.spike, v_ds, p.v_th, None)
        # per step: v' = (1 - s) v_d + s c, u' = (1 - s) u_d + s (u_d + d), s =
        # threshold(v_d - v_th), s not detached: dL/d v_d = g_v (1 - s + slope (c - v_d))
        # + g_u slope d + g_y slope
        by_v = v_ds.neg_() if consume else v_ds.neg()
        by_v = by_v.add_(p.c).mul_(slope).add_(1 - ys)
        by_u = slope * p.d
        by_y = None if g_y is None else slope.mul_(g_y)
        del slope
        # u_d = u + c_u * (b v - u): dL/d v from u's step, and u's carry factor
        # (in the state's dtype: a float32 field in a float64 model is exact there)
        c_u = torch.as_tensor(c_u, dtype=ys.dtype, device=ys.device)
        u_to_v = c_u * torch.as_tensor(p.b, dtype=ys.dtype, device=ys.device)
        u_keep = 1 - c_u
        g_x = torch.empty_like(ys) if need_z else None  # dL/d x_t per step
        carry_v, carry_u = (torch.zeros_like(ys[0]) if g is None else g for g in g_final)
        for t in range(k - 1, -1, -1):
            g_v = carry_v if g_mem is None else g_mem[t] + carry_v
            g_vd = g_v * by_v[t] if by_y is None else torch.addcmul(by_y[t], g_v, by_v[t])
            g_vd = torch.addcmul(g_vd, carry_u, by_u[t])
            # v_d = v + c_v * sum; the sum reads x_t, u and v
            g_sum = g_vd * c_v if g_x is None else torch.mul(g_vd, c_v, out=g_x[t])
            carry_v = torch.addcmul(torch.addcmul(g_vd, g_sum, slope_in[t]), carry_u, u_to_v)
            carry_u = torch.sub(carry_u * u_keep, g_sum)
        return g_x, [carry_v, carry_u], []
