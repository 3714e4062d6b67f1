"""The chunk kernel of snnTorch's ``Alpha`` neuron: two synaptic currents and a membrane.

snnTorch's step (``Alpha._base_state_function`` and its resets), per element, with
``a = alpha.clamp(0, 1)``, ``b = beta.clamp(0, 1)``, ``tau = log(a) / (log(b) - log(a)) + 1``
and ``r`` the reset (the spike of the membrane entering the step, no gradient)::

    E = a * exc + z                    I = b * inh - z                  M = tau * (E + I)
    subtract:  exc' = E - thr * r      inh' = I - I * r                 mem' = M - (-inh) * r
    zero:      exc' = E - E * r        inh' = I - I * r                 mem' = M - M * r
    none:      exc' = E                inh' = I                         mem' = M

and the spike ``s = H(mem' - thr)``, the output ``s * graded``. The membrane carries nothing
into the next step but its reset: the gradients run back through the two currents only
(``dE`` and ``dI`` below), with the subtract reset's ``(-inh) * r`` handing the membrane's
gradient to the previous inhibitory current.

The forward repeats these operations in this order on whole steps (spikes, states and
membranes bitwise snnTorch's); the backward is written out, with ``tau``'s gradient taken by
autograd through snnTorch's own formula (one call per chunk). snnTorch 1.0's
``learn_alpha=True`` fails in its constructor; ``beta`` and ``threshold`` may be learnable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from spikeckpt.adapters.kernels import (
    Reset,
    Spike,
    SpikeGrad,
    SurrogateKernel,
    as_spikes,
    emitted,
    is_unit,
    per_leaf,
    reduce_product,
    reduce_to,
    surrogate_grad,
)
from spikeckpt.adapters.kernels import _aligned as aligned
from spikeckpt.adapters.kernels import _keeps_dtype as keeps_dtype
from spikeckpt.adapters.kernels import _same_layout as same_layout
from spikeckpt.adapters.kernels import _wanted as wanted
from spikeckpt.engine.fused import Emit, Emitted, EmittedGrad
from spikeckpt.engine.grad import grad as engine_grad
from spikeckpt.errors import ConfigError

__all__ = ["AlphaKernel", "alpha_tau"]


def alpha_tau(a: Tensor, b: Tensor) -> Tensor:
    """snnTorch's ``tau_alpha`` of the clamped ``a``, ``b`` (its own operations)."""
    return torch.log(a) / (torch.log(b) - torch.log(a)) + 1


class AlphaKernel(SurrogateKernel):
    """snnTorch ``Alpha``: state ``(syn_exc, syn_inh, mem)``, over a chunk.

    Args:
        tensors: ``() -> (alpha, beta, threshold, graded)``, the module's current tensors.
        spike: the surrogate spike function.
        reset: ``"subtract"``, ``"zero_after"`` (snnTorch's ``"zero"``) or ``"none"``.
        spike_grad: the surrogate's backward written out, or None (its own, by autograd).
    """

    membrane: int | None = 2
    emits_states = True
    binary_leaves: tuple[int, ...] = ()

    def __init__(
        self,
        tensors: Callable[[], tuple[Tensor, Tensor, Tensor, Tensor]],
        spike: Spike,
        reset: Reset,
        spike_grad: SpikeGrad | None = None,
    ) -> None:
        if reset not in ("subtract", "zero_after", "none"):
            raise ConfigError(f"Alpha resets by subtract, zero_after or none, not {reset!r}")
        super().__init__(tensors, spike, reset, spike_grad)

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        return len(leaves) == 3 and same_layout(leaves, z) and keeps_dtype(self, leaves, z)

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
        """``(final [exc, inh, mem], y (k, B, ...), mem (k, B, ...) or None, saved)`` (with
        ``emit``: a tuple of the numbered leaves after each step in place of ``mem``);
        ``saved``: the membranes ``(k + 1, ...)``, the spikes ``(k + 1, ...)`` (bool) and,
        where ``alpha`` or ``beta`` needs a gradient, the currents entering each step and
        ``E + I`` of each step."""
        alpha, beta, thr, graded = self.tensors()
        a, b = alpha.clamp(0, 1), beta.clamp(0, 1)
        tau = alpha_tau(a, b)
        exc, inh, mem = leaves
        learn = keep and (alpha.requires_grad or beta.requires_grad)
        # the currents after each step (row 0: before the chunk), where saved or emitted
        hold = [learn or (want_mem and emit is not None and i in emit) for i in (0, 1)]
        fired = mem - thr > 0
        mems, fires = [mem], [fired]
        excs, inhs, sums = [exc], [inh], []
        for z_t in z.unbind(0):
            r = as_spikes(fired, mem.dtype)
            e = a * exc + z_t
            i = b * inh - z_t
            total = e + i
            base = tau * total
            if learn:
                sums.append(total)
            if self.reset == "subtract":
                mem = base - (-inh) * r
                exc = e - thr * r
                inh = i - (b * inh - z_t) * r
            elif self.reset == "zero_after":
                exc, inh, mem = e - e * r, i - i * r, base - base * r
            else:
                exc, inh, mem = e, i, base
            fired = mem - thr > 0
            fires.append(fired)
            if keep or want_mem:
                mems.append(mem)
            if hold[0]:
                excs.append(exc)
            if hold[1]:
                inhs.append(inh)
        y = None
        if want_y:
            s = as_spikes(torch.stack(fires[1:]))
            y = s if is_unit(graded) else s * graded
        mem_all = torch.stack(mems) if keep or want_mem else None
        exc_all, inh_all = [
            torch.stack(t) if h else None for t, h in zip((excs, inhs), hold, strict=True)
        ]
        saved = None
        if keep:
            currents = [t[:-1] if learn else None for t in (exc_all, inh_all)]  # type: ignore[index]
            saved = (mem_all, torch.stack(fires), *currents, torch.stack(sums) if learn else None)
        return [exc, inh, mem], y, emitted(want_mem, emit, (exc_all, inh_all, mem_all), 2), saved

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
        mems, fired, *currents = saved
        alpha, beta, thr, graded = self.tensors()
        a, b = alpha.clamp(0, 1), beta.clamp(0, 1)
        tau = alpha_tau(a, b)
        k = mems.shape[0] - 1
        g_excs, g_inhs, g_mem = per_leaf(g_mem, emit, 3, 2)  # dL/d each leaf given per step
        want = wanted([alpha, beta, thr, graded], need_params)
        thr_grad = graded_grad = None
        if g_y is not None:
            g_s = g_y if is_unit(graded) else g_y * graded
            g_m = surrogate_grad(self.spike, mems[1:], thr, g_s, self.spike_grad)
            if want[2]:
                thr_grad = -reduce_to(g_m, thr)
            if want[3]:
                graded_grad = reduce_product(g_y, fired[1:], graded)
        else:
            g_m = torch.zeros_like(mems[1:])
        if g_mem is not None:
            g_m += g_mem
        if g_final[2] is not None:
            g_m[k - 1] += g_final[2]
        r = fired[:-1].to(g_m.dtype)  # the reset entering each step
        g_base = g_m - g_m * r if self.reset == "zero_after" else g_m  # dL/d (tau * (E + I))
        g_total = tau * g_base
        g_e, g_i = torch.empty_like(g_m), torch.empty_like(g_m)
        carry_e, carry_i = g_final[0], g_final[1]  # dL/d exc, inh leaving the step
        thr_sub = None  # subtract: dL/d thr through exc' = E - thr * r
        for t in range(k - 1, -1, -1):
            g_e[t] = g_total[t]
            g_i[t] = g_total[t]
            if g_excs is not None:  # exc' and inh' of step t are emitted: their own gradients
                carry_e = g_excs[t] if carry_e is None else carry_e + g_excs[t]
            if g_inhs is not None:
                carry_i = g_inhs[t] if carry_i is None else carry_i + g_inhs[t]
            if carry_e is not None:
                if self.reset == "subtract" and want[2]:
                    part = carry_e * r[t]
                    thr_sub = part if thr_sub is None else thr_sub + part
                g_e[t] += carry_e - carry_e * r[t] if self.reset == "zero_after" else carry_e
            if carry_i is not None:
                g_i[t] += carry_i if self.reset == "none" else carry_i - carry_i * r[t]
            carry_e = a * g_e[t]
            carry_i = b * g_i[t]
            if self.reset == "subtract":
                carry_i = carry_i + g_m[t] * r[t]  # mem' = M - (-inh) * r
        if thr_sub is not None:
            part = reduce_to(thr_sub, thr)
            thr_grad = -part if thr_grad is None else thr_grad - part
        alpha_grad = beta_grad = None
        if want[0] or want[1]:
            alpha_grad, beta_grad = self._decay_grads(
                alpha, beta, currents, g_e, g_i, g_base, want[0], want[1]
            )
        g_z = g_e - g_i if need_z else None
        return (
            g_z,
            [carry_e, carry_i, None],
            aligned(
                [alpha, beta, thr, graded],
                [alpha_grad, beta_grad, thr_grad, graded_grad],
                need_params,
            ),
        )

    @staticmethod
    def _decay_grads(
        alpha: Tensor,
        beta: Tensor,
        currents: Sequence[Tensor],
        g_e: Tensor,
        g_i: Tensor,
        g_base: Tensor,
        want_alpha: bool,
        want_beta: bool,
    ) -> tuple[Tensor | None, Tensor | None]:
        """dL/d alpha and dL/d beta: through ``E = a * exc + z``, ``I = b * inh - z`` and
        ``tau(a, b)`` (by autograd through the clamps and snnTorch's formula)."""
        excs, inhs, sums = currents
        with torch.enable_grad():
            leaves = [alpha.detach().requires_grad_(), beta.detach().requires_grad_()]
            a, b = leaves[0].clamp(0, 1), leaves[1].clamp(0, 1)
            tau = alpha_tau(a, b)
            grads = [
                reduce_product(g_e, excs, a),
                reduce_product(g_i, inhs, b),
                reduce_product(g_base, sums, tau),
            ]
            found = engine_grad([a, b, tau], leaves, grads)
        got = [
            g if g is not None else torch.zeros_like(p)
            for g, p in zip(found, (alpha, beta), strict=True)
        ]
        return (got[0] if want_alpha else None), (got[1] if want_beta else None)
