"""The chunk kernels of Norse's integrate-and-fire (``IAFCell`` / ``IAF``,
``iaf_feed_forward_step``), box leaky integrator (``LIBoxCell`` / ``LIBox``,
``li_box_feed_forward_step``) and conductance-based LIF (``coba_lif_feed_forward_step``)
steps: `NorseIAFKernel`, `NorseLIBoxKernel`, `NorseCobaKernel`.

Per step, as Norse writes it, ``x_t`` the block's synaptic input::

    IAF (v):        v_n = v + x_t;  z = threshold(v_n - v_th);  v' = (1 - z) * v_n + z * v_reset
    LIBox (v):      v' = v + dt * tau_mem_inv * ((v_leak - v) + x_t);  the output is v'
    CobaLIF (v, g_e, g_i):
        g_e = g_e + relu(x_t);  g_i = g_i + relu(-x_t)
        g_e = g_e + -dt * tau_syn_exc_inv * g_e;  g_i = g_i + -dt * tau_syn_inh_inv * g_i
        v_d = v + dt * c_m_inv * ((g_l * (v_rest - v) + g_e * (e_rev_E - v))
                                  + g_i * (e_rev_I - v))
        z   = threshold(v_d - v_thresh);  v' = (1 - z) * v_d + z * v_reset

The forwards run these operations in this order (spikes, membranes and states bitwise
Norse's); the backwards run the adjoint recurrences by hand (Norse detaches nothing: the spike's
gradient passes through the reset), the surrogate's slope from Norse's own ``threshold`` once
per chunk.

A learnable field (a tensor that takes a gradient): IAF's ``v_th`` and ``v_reset`` and LIBox's
``tau_mem_inv`` and ``v_leak`` get their gradients from the kernel (Norse's own
``IAFCell.initial_state`` makes ``v_reset`` take one); a learnable CobaLIF field keeps Norse's
per-step call (`NorseCobaKernel.accepts` declines it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from spikeckpt.adapters.kernels import (
    NorseFieldsKernel,
    _grads_for,
    field_fits,
    per_leaf,
    reduce_product,
    surrogate_grad,
)
from spikeckpt.engine.fused import Emit, EmittedGrad

__all__ = ["NorseCobaKernel", "NorseIAFKernel", "NorseLIBoxKernel", "simple_kernel"]

#: the fields of ``IAFParameters`` the step reads
IAF_FIELDS = ("v_th", "v_reset")
#: those of ``LIBoxParameters``
LIBOX_FIELDS = ("tau_mem_inv", "v_leak")
#: those of ``CobaLIFParameters``
COBA_FIELDS = (
    *("tau_syn_exc_inv", "tau_syn_inh_inv", "c_m_inv", "g_l", "e_rev_I", "e_rev_E"),
    *("v_rest", "v_reset", "v_thresh"),
)


class _SimpleKernel(NorseFieldsKernel):
    """`NorseFieldsKernel` whose fields may take gradients where ``learnable``."""

    learnable = False

    def fields_fit(self, p: Any, like: Tensor) -> bool:
        alpha = getattr(p, "alpha", None)
        return all(
            field_fits(getattr(p, f, None), like, self.learnable) for f in self.fields
        ) and not (isinstance(alpha, Tensor) and alpha.requires_grad)

    def _param_grads(
        self, makers: dict[str, Callable[[], Tensor]], need: Sequence[bool]
    ) -> list[Tensor | None]:
        """The gradients of the learnable fields (``need`` aligned with those), each in its
        field's shape, device and dtype."""
        p = self.p()
        pairs = [(getattr(p, f), makers[f]) for f in self.fields]
        tensors = [(t, make) for t, make in pairs if isinstance(t, Tensor)]
        grads = _grads_for(tensors, need)
        wanted = [t for t, _ in tensors if t.requires_grad]
        return [
            None if g is None else g.to(device=t.device, dtype=t.dtype)
            for g, t in zip(grads, wanted, strict=True)
        ]


def _or_zeros(t: Tensor | None, like: Tensor) -> Tensor:
    """``t`` or zeros like ``like``."""
    return torch.zeros_like(like) if t is None else t.reshape(like.shape)


def _learns(p: Any, fields: Sequence[str]) -> bool:
    """Whether a field of ``p`` named in ``fields`` takes a gradient."""
    return any(isinstance(t, Tensor) and t.requires_grad for t in (getattr(p, f) for f in fields))


class NorseIAFKernel(_SimpleKernel):
    """Norse's ``iaf_feed_forward_step`` over a chunk, state ``(v,)``; the input ``x (k, B,
    ...)`` jumps the membrane (see the module docstring).

    Built as `NorseFieldsKernel` (``params``: the module's current ``IAFParameters``).
    """

    learnable = True

    fields = IAF_FIELDS
    leaf_count = 1

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
        v = leaves[0]
        k = z.shape[0]
        ys = v.new_empty((k, *v.shape))
        v_ns = v.new_empty((k, *v.shape)) if keep else None  # v before the reset
        vs = v.new_empty((k, *v.shape)) if want_mem else None
        zero = torch.as_tensor(0.0)  # Norse's heaviside: gt(u, 0) in u's dtype
        for t, x_t in enumerate(z.unbind(0)):
            v_n = v + x_t if v_ns is None else torch.add(v, x_t, out=v_ns[t])
            s = torch.gt(v_n - p.v_th, zero, out=ys[t])
            kept, reset = (1 - s) * v_n, s * p.v_reset
            v = kept + reset if vs is None else torch.add(kept, reset, out=vs[t])
        if vs is not None:
            v = v.clone()  # not a view of the membranes returned beside it
        return [v], ys if want_y else None, vs, (v_ns, ys) if keep else None

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
        g_mem = per_leaf(g_mem, emit, 1, 0)[0]
        v_ns, ys = saved  # (k, B, ...) v before the reset, the spikes
        p = self.p()
        k = ys.shape[0]
        slope = surrogate_grad(self.spike, v_ns, p.v_th, None)
        drop = v_ns.neg_().add_(p.v_reset) if consume else p.v_reset - v_ns  # d v' / d s
        # d v' / d v_n = (1 - s) + slope * (v_reset - v_n); the outputs' share slope * g_y
        through = torch.mul(slope, drop).add_(1 - ys)
        outer = None if g_y is None else slope * g_y
        g_x = torch.empty_like(slope)  # dL/d v_n = dL/d x_t = dL/d v per step
        carry = torch.zeros_like(slope[0]) if g_final[0] is None else g_final[0]
        for t in range(k - 1, -1, -1):
            g_v = carry if g_mem is None else g_mem[t] + carry  # dL/d v'
            if outer is None:
                carry = torch.mul(g_v, through[t], out=g_x[t])
            else:
                carry = torch.addcmul(outer[t], g_v, through[t], out=g_x[t])
        if k:
            carry = carry.clone()  # not a view of the input's gradient

        def g_v_all() -> Tensor:
            """dL/d v' per step: the next step's dL/d v (the last: the final state's)."""
            after = torch.cat([g_x[1:], _or_zeros(g_final[0], g_x[:1])])
            return after if g_mem is None else after + g_mem

        def g_th() -> Tensor:  # u = v_n - v_th: dL/du = slope * (g_v' (v_reset - v_n) + g_y)
            g_s = g_v_all() * drop
            return -(slope * (g_s if g_y is None else g_s + g_y)).sum(0)

        def g_reset() -> Tensor:
            return reduce_product(g_v_all(), ys, p.v_reset)

        grads = self._param_grads({"v_th": g_th, "v_reset": g_reset}, need_params)
        return g_x if need_z else None, [carry], grads


class NorseLIBoxKernel(_SimpleKernel):
    """Norse's ``li_box_feed_forward_step`` over a chunk, state ``(v,)``, the output the
    membrane (not binary); the input ``x (k, B, ...)`` drives the membrane directly.

    Args:
        params: ``() -> p``, the module's current ``LIBoxParameters``.
        dt: its time step.
        usable: ``() -> bool``, whether the module still has the step the kernel computes.
    """

    learnable = True
    binary_output = False

    fields = LIBOX_FIELDS
    leaf_count = 1

    def __init__(
        self, params: Callable[[], Any], dt: float, usable: Callable[[], bool] = lambda: True
    ) -> None:
        super().__init__(params, dt, _no_spike, usable)

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
        c_m = self.dt * p.tau_mem_inv
        v = v0 = leaves[0]
        ys = v.new_empty((z.shape[0], *v.shape))
        for t, x_t in enumerate(z.unbind(0)):
            v = torch.add(v, c_m * ((p.v_leak - v) + x_t), out=ys[t])
        v = v.clone() if z.shape[0] else v  # not a view of the outputs
        # the parameters' gradients read the chunk's membranes and input; the rest its length
        saved = (v0, ys, z) if _learns(p, self.fields) else (None, ys, None)
        return [v], ys, ys.clone() if want_mem else None, saved if keep else None

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
        g_mem = per_leaf(g_mem, emit, 1, 0)[0]
        v0, vs, z = saved  # (B, ...) v entering the chunk, (k, B, ...) v after each step, x
        p = self.p()
        c_m = self.dt * p.tau_mem_inv
        outer = g_y if g_mem is None else g_mem if g_y is None else g_mem + g_y
        keep_v = 1 - c_m  # v' = v + c_m * ((v_leak - v) + x): d v' / d v
        g_vs = torch.empty_like(vs)  # dL/d v' per step
        carry = torch.zeros_like(vs[0]) if g_final[0] is None else g_final[0]
        for t in range(vs.shape[0] - 1, -1, -1):
            g_v = carry if outer is None else torch.add(carry, outer[t], out=g_vs[t])
            if outer is None:
                g_vs[t] = g_v
            carry = g_v * keep_v
        g_x = g_vs * c_m if need_z else None  # d v' / d x

        def g_tau() -> Tensor:
            assert v0 is not None
            v_in = torch.cat([v0.expand_as(vs[0])[None], vs[:-1]])
            return self.dt * reduce_product(g_vs, (p.v_leak - v_in) + z, p.tau_mem_inv)

        def g_leak() -> Tensor:
            return g_vs.sum(0) * c_m

        grads = self._param_grads({"tau_mem_inv": g_tau, "v_leak": g_leak}, need_params)
        return g_x, [carry], grads


def _no_spike(u: Tensor) -> Tensor:
    """LIBox has no spike (its kernel never calls one)."""
    raise AssertionError("LIBox has no spike")


class NorseCobaKernel(_SimpleKernel):
    """Norse's ``coba_lif_feed_forward_step`` over a chunk, state ``(v, g_e, g_i)``; the
    input ``x (k, B, ...)``'s positive part jumps the excitatory conductance, its negative part
    the inhibitory one (see the module docstring).

    Built as `NorseFieldsKernel` (``params``: the module's current ``CobaLIFParameters``).
    """

    fields = COBA_FIELDS
    leaf_count = 3

    def _rates(self, p: Any) -> tuple[Any, Any, Any]:
        """``(-dt * tau_syn_exc_inv, -dt * tau_syn_inh_inv, dt * c_m_inv)``: the products
        Norse's step forms first (the same values)."""
        dt = self.dt
        return -dt * p.tau_syn_exc_inv, -dt * p.tau_syn_inh_inv, dt * p.c_m_inv

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
        c_e, c_i, c_v = self._rates(p)
        v, g_e, g_i = leaves
        v0, shape = v, (z.shape[0], *v.shape)
        ys = v.new_empty(shape)
        v_ds, g_es, g_is = (v.new_empty(shape) for _ in range(3)) if keep else (None,) * 3
        vs = v.new_empty(shape) if want_mem else None
        zero = torch.as_tensor(0.0)  # Norse's heaviside: gt(u, 0) in u's dtype
        jump_e, jump_i = torch.relu(z), torch.relu(-z)  # elementwise: each step's values
        for t in range(z.shape[0]):
            g_e = g_e + jump_e[t]
            g_i = g_i + jump_i[t]
            g_e = g_e + c_e * g_e if g_es is None else torch.add(g_e, c_e * g_e, out=g_es[t])
            g_i = g_i + c_i * g_i if g_is is None else torch.add(g_i, c_i * g_i, out=g_is[t])
            leak = p.g_l * (p.v_rest - v) + g_e * (p.e_rev_E - v)
            dv = c_v * (leak + g_i * (p.e_rev_I - v))
            v_d = v + dv if v_ds is None else torch.add(v, dv, out=v_ds[t])
            s = torch.gt(v_d - p.v_thresh, zero, out=ys[t])
            kept, reset = (1 - s) * v_d, s * p.v_reset
            v = kept + reset if vs is None else torch.add(kept, reset, out=vs[t])
        if vs is not None:
            v = v.clone()  # not a view of the membranes returned beside it
        final = [v, g_e, g_i]
        if keep:  # not views of the conductances kept for the backward
            final = [v, g_e.clone(), g_i.clone()] if z.shape[0] else final
        saved = (v_ds, ys, g_es, g_is, v0, z) if keep else None
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
        g_mem = per_leaf(g_mem, emit, 3, 0)[0]
        # (k, B, ...) v before the reset, spikes, conductances after the decay; (B, ...) v
        # entering the chunk; (k, B, ...) the input
        v_ds, ys, g_es, g_is, v0, z = saved
        p = self.p()
        c_e, c_i, c_v = self._rates(p)
        k = ys.shape[0]
        v_in = torch.empty_like(v_ds)  # v entering each step (the forward's ops: bitwise)
        v_in[0] = v0
        keep_v = 1 - ys  # d v' / d v_d
        if k > 1:
            torch.add(keep_v[:-1] * v_ds[:-1], ys[:-1] * p.v_reset, out=v_in[1:])
        # d v_d / d v = 1 - c_v * (g_l + g_e + g_i); d v_d / d g_e = c_v * (e_rev_E - v), ...
        to_v = (-((p.g_l + g_es) + g_is)).mul_(c_v).add_(1)
        to_e, to_i = (p.e_rev_E - v_in).mul_(c_v), (p.e_rev_I - v_in).mul_(c_v)
        del v_in
        slope = surrogate_grad(self.spike, v_ds, p.v_thresh, None)
        drop = v_ds.neg_().add_(p.v_reset) if consume else p.v_reset - v_ds  # d v' / d s
        # d v' / d v_d = (1 - s) + slope * (v_reset - v_d); the outputs' share slope * g_y
        outer = None if g_y is None else slope * g_y
        through = slope.mul_(drop).add_(keep_v)
        del drop, keep_v
        decay_e, decay_i = 1 + c_e, 1 + c_i  # g' = g + c * g
        g_ae = torch.empty_like(ys)  # dL/d g_e after each step's jump (before its decay)
        g_ai = torch.empty_like(ys)
        carry_v, carry_e, carry_i = (torch.zeros_like(ys[0]) if g is None else g for g in g_final)
        for t in range(k - 1, -1, -1):
            g_v = carry_v if g_mem is None else g_mem[t] + carry_v  # dL/d v'
            g_vd = g_v * through[t] if outer is None else torch.addcmul(outer[t], g_v, through[t])
            carry_v = g_vd * to_v[t]  # v_d = v + c_v * (... the sum reads v and the g's)
            carry_e = torch.addcmul(carry_e, g_vd, to_e[t], out=g_ae[t]).mul_(decay_e)
            carry_i = torch.addcmul(carry_i, g_vd, to_i[t], out=g_ai[t]).mul_(decay_i)
        g_x = None
        if need_z:  # relu(x) jumps g_e, relu(-x) g_i (relu's gradient 0 where x <= 0)
            g_x = torch.where(z <= 0, 0.0, g_ae) - torch.where(z >= 0, 0.0, g_ai)
        finals: list[Tensor | None] = [t.clone() if k else t for t in (carry_v, carry_e, carry_i)]
        return g_x, finals, [None] * len(need_params)


def simple_kernel(
    step: str,
    params: Callable[[], Any],
    dt: float,
    spike: Callable[[Tensor], Tensor],
    usable: Callable[[], bool],
) -> NorseIAFKernel | NorseLIBoxKernel | NorseCobaKernel:
    """The kernel of Norse's step ``step`` (``"iaf"``, ``"libox"`` or ``"coba"``)."""
    if step == "iaf":
        return NorseIAFKernel(params, dt, spike, usable)
    if step == "libox":
        return NorseLIBoxKernel(params, dt, usable)
    return NorseCobaKernel(params, dt, spike, usable)
