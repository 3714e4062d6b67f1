"""Norse's ``LIFRecurrentCell`` chunk on the CPU: torch's products, a compiled elementwise step.

Each step of the cell is two matrix products (the input's, unless the chunk's was gathered,
and the fed-back spikes') and about a dozen elementwise operations, each a full pass over the
step's ``B x H`` values with a temporary of that size: at 128 x 512 neurons those passes and
the copies into the chunk's buffers took longer than the products (measured: ``aten::copy_``
and the adds, multiplies and subtracts 125 ms of a 460 ms training step). Here the products
stay torch's (the same calls on the same tensors, so the same sums) and the elementwise part of
a step is one compiled pass (`spikeckpt.adapters.jit_loops.lif_recurrent_step_jit` and
``lif_recurrent_back_step_jit``): the same IEEE operations in the same order, so spikes,
states and gradients are bitwise those of `NorseRecurrentKernel`'s torch loop, which runs
wherever these functions decline (no Numba, CUDA, other dtypes, a field wider than a step,
while ``torch.compile`` traces).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from spikeckpt.adapters import host_loops, jit_loops

__all__ = [
    "lif_recurrent_backward_on_host",
    "lif_recurrent_forward_on_host",
    "lsnn_recurrent_forward_on_host",
    "recurrent_leaky_forward_on_host",
]


def _rows(tensor: Tensor | None, like: np.ndarray) -> np.ndarray:
    """``tensor`` ``(k, B, ...)`` as a ``(k, B * ...)`` array (a contiguous copy where it is
    not: only for tensors the step reads), or ``like`` for None (never read)."""
    if tensor is None:
        return like
    return tensor.detach().contiguous().numpy().reshape(tensor.shape[0], -1)


def _writable(*buffers: Tensor | None) -> bool:
    """Whether the buffers the compiled step writes are contiguous (their arrays are views),
    and the states it starts from: the torch loop's operations keep a state's layout (a
    transposed one), and a product over spikes in another layout sums in another order."""
    return all(t is None or t.is_contiguous() for t in buffers)


def _flat_copy(tensor: Tensor | None, like: Tensor) -> Tensor:
    """A contiguous copy of ``tensor`` broadcast to ``like``'s shape (zeros for None): a
    buffer the compiled step may write in place."""
    out = torch.zeros_like(like, memory_format=torch.contiguous_format)
    if tensor is not None:
        out.copy_(tensor.expand(like.shape))
    return out


def _per_neuron(params: Sequence[Tensor], like: Tensor) -> np.ndarray | None:
    """``params`` as a ``(len(params), H)`` array for states ``like`` ``(B, H)``, or None
    where one is wider than a neuron's (``(B, H)``, ``(1, H)``: the torch loop runs)."""
    hidden = like.shape[-1]
    if any(np.broadcast_shapes(t.shape, (hidden,)) != (hidden,) for t in params):
        return None
    return host_loops._stacked(torch.Size([hidden]), like, *params)


def lif_recurrent_forward_on_host(
    leaves: Sequence[Tensor],
    z: Tensor,
    current: Tensor | None,
    weights: tuple[Tensor, Tensor],
    params: tuple[Tensor, ...],
    ys: Tensor,
    kept: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
) -> list[Tensor] | None:
    """Run `NorseRecurrentKernel.forward`'s steps: the spikes into ``ys``, each step's
    membrane before and after the reset, drive and current jump into ``kept``'s buffers
    (``(k, B, H)`` each, or None). Returns the final ``[spikes, membrane, current]``, or None
    (nothing written) where it does not run.

    Args:
        leaves: ``(spikes, membrane, current)`` before the chunk, ``(B, H)`` each.
        z: the chunk's input ``(k, B, n_in)``; ``current``: its product ``(k, B, H)`` where
            gathered, else None (each step's ``F.linear(z[t], W_in)``).
        weights: ``(W_in, W_rec)``.
        params: ``(dt * tau_mem_inv, v_leak, v_th, v_reset, -dt * tau_syn_inv)``, tensors
            broadcastable to a step.
    """
    spk0, v0, i0 = leaves
    k = z.shape[0]
    w_in, w_rec = weights
    if not (host_loops.USE_JIT and k) or v0.dim() != 2 or not _writable(ys, *kept, *leaves):
        return None
    written = [t for t in kept if t is not None]
    if host_loops._host_arrays(v0, i0, spk0, ys, w_rec, *written) is None:
        return None
    stacked = _per_neuron(params, v0)
    if stacked is None:
        return None
    ys_rows = _rows(ys, stacked)
    # rows not kept go to scratch rows of their own (never one shared: see the step)
    scratch = v0.new_empty((sum(t is None for t in kept), v0.numel())).numpy()
    spare = iter(scratch)
    rows = [_rows(t, stacked) if t is not None else None for t in kept]
    # step 0's product from the torch loop's own clone (a transposed state's layout sums in
    # another order), the later ones from the spikes' buffer, a fresh aligned tensor as theirs
    first = spk0.clone()
    spk = torch.empty_like(v0, memory_format=torch.contiguous_format)
    v = v0.clone(memory_format=torch.contiguous_format)
    i = i0.clone(memory_format=torch.contiguous_format)
    flat = [t.numpy().reshape(-1) for t in (spk, v, i)]
    step_rows = [next(spare) if r is None else None for r in rows]
    for t in range(k):
        fed = F.linear(z[t], w_in) if current is None else current[t]
        rec = F.linear(first if t == 0 else spk, w_rec)
        jit_loops.lif_recurrent_step_jit(
            flat[2],
            fed.detach().contiguous().numpy().reshape(-1),
            rec.detach().numpy().reshape(-1),
            flat[1],
            stacked,
            flat[0],
            ys_rows[t],
            tuple(s if r is None else r[t] for r, s in zip(rows, step_rows, strict=True)),
        )
    return [spk, v, i]


def lif_recurrent_backward_on_host(
    g_y: Tensor | None,
    g_final: Sequence[Tensor | None],
    g_mem: Tensor | None,
    slope: Tensor,
    ys: Tensor,
    w_rec: Tensor,
    params: tuple[Tensor, Tensor],
    g_jump: Tensor,
    per_step: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
) -> list[Tensor | None] | None:
    """Run `NorseRecurrentKernel.backward`'s loop from the last step to the first: dL/d
    each step's current jump into ``g_jump`` ``(k, B, H)``, the learnable fields' per-step
    terms into ``per_step``'s buffers (dL/d v_d, the current's carry, dL/d the membrane after
    the reset, dL/d the spike; ``(k, B, H)`` zeros or None). Returns the gradients of the
    states before the chunk ``[spikes, membrane, current]``, or None (nothing written) where
    it does not run.

    Args:
        g_y, g_mem: the outputs' and the membranes' gradients ``(k, B, H)``, or None.
        g_final: the final states' gradients (``[spikes, membrane, current]``, each
            broadcastable to a step, or None).
        slope: the surrogate's derivative at each step ``(k, B, H)``; ``ys``: the spikes.
        params: ``(c_m, c_s)`` (``dt * tau_mem_inv``, ``-dt * tau_syn_inv``).
    """
    k = ys.shape[0]
    shape = ys.shape[1:]
    given = [t for t in (g_y, g_mem, *g_final) if t is not None]
    if not (host_loops.USE_JIT and k) or len(shape) != 2:
        return None
    if not _writable(g_jump, *per_step, *g_final):
        return None
    written = [t for t in per_step if t is not None]
    arrays = host_loops._host_arrays(ys, slope, g_jump, w_rec, *given, *written)
    if arrays is None or any(t.shape != ys.shape for t in (g_y, g_mem) if t is not None):
        return None
    if any(not host_loops._steps_fit(ys[0], t) for t in g_final if t is not None):
        return None
    stacked = _per_neuron(params, ys[0])
    if stacked is None:
        return None
    ys_rows = _rows(ys, arrays[0])
    carry_v, carry_i = (_flat_copy(t, ys[0]) for t in g_final[1:])
    g_j = torch.empty_like(carry_v)
    carry_z: Tensor | None = g_final[0]
    z_flat = None if carry_z is None else _flat_copy(carry_z, ys[0]).numpy().reshape(-1)
    flags = [g_y is not None, carry_z is not None, g_mem is not None]
    flags += [t is not None for t in g_final[1:]]
    reads = np.array([t is not None for t in per_step])
    rows = [_rows(t, ys_rows) for t in (g_y, g_mem, slope, g_jump, *per_step)]
    v_flat, i_flat, j_flat = (t.numpy().reshape(-1) for t in (carry_v, carry_i, g_j))
    for t in range(k - 1, -1, -1):
        if z_flat is not None and flags[3] and flags[4] and not reads.any():
            jit_loops.lif_recurrent_back_carried_jit(
                rows[0][t],
                flags[0],
                rows[1][t],
                flags[2],
                (z_flat, v_flat, i_flat),
                rows[2][t],
                ys_rows[t],
                stacked,
                rows[3][t],
                j_flat,
            )
        else:
            jit_loops.lif_recurrent_back_step_jit(
                t,
                rows[0],
                j_flat if z_flat is None else z_flat,
                rows[1],
                v_flat,
                i_flat,
                np.array(flags),
                rows[2],
                ys_rows,
                stacked,
                rows[3],
                j_flat,
                *rows[4:],
                reads,
            )
        carry_z = g_j @ w_rec
        z_flat = carry_z.numpy().reshape(-1)
        flags[1] = flags[3] = flags[4] = True
    return [carry_z, carry_v, carry_i]


#: the resets `jit_loops.recurrent_leaky_step_jit` runs (`RecurrentKernel`'s)
_RESETS = ("none", "subtract", "zero_after")


def recurrent_leaky_forward_on_host(
    z: Tensor,
    leaves: tuple[Tensor, Tensor | None, Tensor],
    params: tuple[Tensor | None, Tensor, Tensor, Tensor],
    rec: Callable[[Tensor], Tensor],
    modes: tuple[str, bool],
    buffers: tuple[Tensor, Tensor, Tensor | None, Tensor | None],
) -> tuple[Tensor, Tensor | None, Tensor] | None:
    """Run `RecurrentKernel.forward`'s steps (snnTorch's ``RLeaky``, ``RSynaptic``): the
    spikes into ``ys``, the step's spikes into ``fires[1:]`` (``fires[0]``: the reset entering
    the chunk, given), the membranes into ``mems[1:]`` and the currents into ``syns[1:]``
    where given. Returns the final ``(spikes, current or None, membrane)``, or None (nothing
    written) where it does not run.

    Args:
        z: the chunk's synaptic input ``(k, B, H)``.
        leaves: ``(spikes, current or None, membrane)`` before the chunk, ``(B, H)`` each.
        params: ``(a or None, b, thr, graded)``: the clamped decays, the threshold, the
            spikes' factor, tensors broadcastable to a neuron's.
        rec: the recurrent map of a step's spikes ``(B, H) -> (B, H)`` (torch's call).
        modes: ``(reset, exact)``: a `jit_loops.RESET_CODES` name (not ``"zero_before"``),
            and whether the spike is ``mem > thr`` (else ``mem - thr > 0``).
        buffers: ``(fires (k + 1, B, H) bool, ys (k, B, H), mems or None, syns or None)``,
            ``mems`` and ``syns`` ``(k + 1, B, H)``.
    """
    spk0, syn0, mem0 = leaves
    a, b, thr, graded = params
    fires, ys, mems, syns = buffers
    k = z.shape[0]
    if not (host_loops.USE_JIT and k) or mem0.dim() != 2 or not _writable(*buffers, *leaves):
        return None
    if not ys.dtype == spk0.dtype == mem0.dtype or modes[0] not in _RESETS:
        return None
    held = [t for t in (syn0, mems, syns) if t is not None]
    if host_loops._host_arrays(mem0, spk0, z, ys, *held) is None or z.shape[1:] != mem0.shape:
        return None
    stacked = _per_neuron((b if a is None else a, b, thr, graded), mem0)
    if stacked is None:
        return None
    # rows not kept go to scratch rows of their own (never one shared: see the step)
    scratch = mem0.new_empty((2, mem0.numel())).numpy()
    first = spk0.clone()  # step 0's product as the torch loop's (see the cell's above)
    spk = torch.empty_like(mem0, memory_format=torch.contiguous_format)
    mem = mem0.clone(memory_format=torch.contiguous_format)
    syn = (syn0 if syn0 is not None else mem0).clone(memory_format=torch.contiguous_format)
    state = (syn.numpy().reshape(-1), mem.numpy().reshape(-1))
    spk_flat = spk.numpy().reshape(-1)
    rows = [_rows(t, scratch) for t in (fires, ys, mems, syns)]
    z_rows = _rows(z, scratch)
    step_modes = (syn0 is not None, jit_loops.RESET_CODES[modes[0]], modes[1])
    for t in range(k):
        fed = rec(first if t == 0 else spk)
        jit_loops.recurrent_leaky_step_jit(
            z_rows[t],
            fed.detach().contiguous().numpy().reshape(-1),
            state,
            rows[0][t],
            rows[0][t + 1],
            stacked,
            step_modes,
            (
                rows[1][t],
                spk_flat,
                scratch[0] if mems is None else rows[2][t + 1],
                scratch[1] if syns is None else rows[3][t + 1],
            ),
        )
    return spk, (syn if syn0 is not None else None), mem


def lsnn_recurrent_forward_on_host(
    leaves: Sequence[Tensor],
    z: Tensor,
    current: Tensor | None,
    weights: tuple[Tensor, Tensor],
    params: tuple[Tensor, ...],
    ys: Tensor,
    kept: tuple[Tensor | None, Tensor | None],
) -> list[Tensor] | None:
    """Run `NorseLSNNKernel.forward`'s steps (Norse's ``LSNNRecurrentCell``): the spikes
    into ``ys``, each step's ``v_d - b_d`` and membrane into ``kept``'s buffers (``(k, B, H)``
    each, or None). Returns the final ``[spikes, membrane, current, threshold]``, or None
    (nothing written) where it does not run.

    Args:
        leaves: ``(spikes, membrane, current, threshold)`` before the chunk, ``(B, H)`` each.
        z, current, weights: as `lif_recurrent_forward_on_host`'s.
        params: ``(c_m, c_s, c_a, v_leak, v_th, v_reset, beta)``, tensors broadcastable to a
            neuron's.
    """
    spk0, v0, i0, b0 = leaves
    k = z.shape[0]
    w_in, w_rec = weights
    if not (host_loops.USE_JIT and k) or v0.dim() != 2 or not _writable(ys, *kept, *leaves):
        return None
    written = [t for t in kept if t is not None]
    if host_loops._host_arrays(v0, i0, b0, spk0, ys, w_rec, *written) is None:
        return None
    stacked = _per_neuron(params, v0)
    if stacked is None:
        return None
    ys_rows = _rows(ys, stacked)
    scratch = v0.new_empty((2, v0.numel())).numpy()  # rows not kept: one each
    rows = [_rows(t, stacked) if t is not None else None for t in kept]
    first = spk0.clone()  # step 0's product as the torch loop's (see the LIF cell's above)
    spk = torch.empty_like(v0, memory_format=torch.contiguous_format)
    state = [t.clone(memory_format=torch.contiguous_format) for t in (v0, i0, b0)]
    flat = tuple(t.numpy().reshape(-1) for t in state)
    spk_flat = spk.numpy().reshape(-1)
    for t in range(k):
        fed = F.linear(z[t], w_in) if current is None else current[t]
        rec = F.linear(first if t == 0 else spk, w_rec)
        jit_loops.lsnn_recurrent_step_jit(
            flat,
            fed.detach().contiguous().numpy().reshape(-1),
            rec.detach().numpy().reshape(-1),
            stacked,
            (
                ys_rows[t],
                spk_flat,
                scratch[0] if rows[0] is None else rows[0][t],
                scratch[1] if rows[1] is None else rows[1][t],
            ),
        )
    return [spk, *state]
