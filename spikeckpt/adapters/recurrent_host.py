"""Recurrent neurons' chunks on the CPU: torch's products, a compiled elementwise step.

A step of a neuron with recurrent weights inside it (Norse's ``LIFRecurrentCell`` and
``LSNNRecurrentCell``, snnTorch's ``RLeaky`` and ``RSynaptic``) is one or two matrix products
(the input's, unless the chunk's was gathered, and the fed-back spikes') and about a dozen
elementwise operations, each a full pass over the step's ``B x H`` values with a temporary of
that size: at 128 x 512 neurons those passes and the copies into the chunk's buffers took
longer than the products (``LIFRecurrentCell``, measured: ``aten::copy_`` and the adds,
multiplies and subtracts 125 ms of a 460 ms training step). Here the products stay torch's
(the same calls on the same tensors, so the same sums) and the elementwise part of a step is
one compiled pass (`spikeckpt.adapters.jit_loops`: ``lif_recurrent_*``,
``lsnn_recurrent_*``, ``recurrent_leaky_step_jit``): the same IEEE operations in the
same order, so spikes, states and gradients are bitwise those of the kernels' torch loops,
which run wherever these functions decline (no Numba, CUDA, other dtypes, a field wider than
a neuron's, a state in another layout, while ``torch.compile`` traces).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from spikeckpt.adapters import host_loops, jit_loops

__all__ = [
    "lif_recurrent_backward_on_host",
    "lif_recurrent_forward_on_host",
    "lsnn_recurrent_backward_on_host",
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


def _flat(tensor: Tensor) -> np.ndarray:
    """``tensor`` as a 1-D array (a contiguous copy where it is not: read only)."""
    return tensor.detach().contiguous().numpy().reshape(-1)


class _Compiled(NamedTuple):
    """What a compiled recurrent forward reads and writes, made by `_compiled`."""

    #: ``(len(params), H)``: the neuron's fields, one row each
    stacked: np.ndarray
    #: step 0's spikes as the torch loop feeds them back (its own clone: a transposed state's
    #: product sums in another order), ``(B, H)``
    first: Tensor
    #: the spikes' buffer, fed back from step 1 on (a fresh aligned tensor, as the loop's)
    spk: Tensor
    #: contiguous copies of the other state leaves, updated in place
    states: list[Tensor]
    #: ``(n,)`` views of ``spk`` and ``states``
    flat: tuple[np.ndarray, ...]
    #: ``(k, n)``: the chunk's spikes
    ys: np.ndarray
    #: ``(k, n)`` each: the buffers kept per step, a ``(1, n)`` scratch row of its own for one
    #: not kept (never one shared: the steps run vectorized only on distinct outputs)
    kept: list[np.ndarray]

    def fed_back(self, t: int) -> Tensor:
        """The spikes step ``t``'s recurrent product reads."""
        return self.first if t == 0 else self.spk

    def kept_at(self, t: int) -> tuple[np.ndarray, ...]:
        """Step ``t``'s rows of `kept` (a scratch row has one)."""
        return tuple(rows[t % len(rows)] for rows in self.kept)


def _compiled(
    spk0: Tensor,
    states: Sequence[Tensor],
    ys: Tensor,
    kept: Sequence[Tensor | None],
    params: Sequence[Tensor],
    also: Sequence[Tensor] = (),
) -> _Compiled | None:
    """The working set of a compiled forward over the chunk whose spikes go to ``ys``
    ``(k, B, H)`` from the spikes ``spk0`` and the other ``states`` ``(B, H)``, keeping
    ``kept`` ``(k, B, H)`` per step (or None), or None where it declines: no Numba, an empty
    chunk, states not ``(B, H)``, a buffer or state not contiguous, tensors (``also`` too) not
    all CPU and of one float dtype, a field wider than a neuron's."""
    like = states[-1]
    if not (host_loops.USE_JIT and ys.shape[0]) or like.dim() != 2:
        return None
    written = [t for t in kept if t is not None]
    if not _writable(ys, *written, spk0, *states):
        return None
    if host_loops._host_arrays(like, *states, spk0, ys, *also, *written) is None:
        return None
    stacked = _per_neuron(params, like)
    if stacked is None:
        return None
    spk = torch.empty_like(like, memory_format=torch.contiguous_format)
    copies = [t.clone(memory_format=torch.contiguous_format) for t in states]
    flat = tuple(t.numpy().reshape(-1) for t in (spk, *copies))
    scratch = like.numel()
    rows = [
        _rows(t, stacked) if t is not None else like.new_empty((1, scratch)).numpy() for t in kept
    ]
    return _Compiled(stacked, spk0.clone(), spk, copies, flat, _rows(ys, stacked), rows)


def _products(
    run: _Compiled, z: Tensor, current: Tensor | None, weights: tuple[Tensor, Tensor]
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """A Norse cell's steps ``t`` with their two products, the input's (``current[t]``
    where gathered, else ``F.linear(z[t], W_in)``) and the fed-back spikes' (each made after
    the step before ran)."""
    w_in, w_rec = weights
    for t in range(z.shape[0]):
        fed = F.linear(z[t], w_in) if current is None else current[t]
        yield t, _flat(fed), _flat(F.linear(run.fed_back(t), w_rec))


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
    run = _compiled(spk0, (v0, i0), ys, kept, params, also=(weights[1],))
    if run is None:
        return None
    spk, v, i = run.flat
    for t, fed, rec in _products(run, z, current, weights):
        jit_loops.lif_recurrent_step_jit(
            i, fed, rec, v, run.stacked, spk, run.ys[t], run.kept_at(t)
        )
    return [run.spk, *run.states]


def _backward_fits(
    ys: Tensor,
    slope: Tensor,
    g_jump: Tensor,
    w_rec: Tensor,
    per_step_grads: tuple[Tensor | None, Tensor | None],
    g_final: Sequence[Tensor | None],
    params: Sequence[Tensor],
    written: Sequence[Tensor] = (),
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(ys as (k, B * H) rows, the fields stacked per neuron)`` where a compiled recurrent
    backward runs over the chunk's spikes ``ys`` ``(k, B, H)``, else None: no Numba, an empty
    chunk, states not ``(B, H)``, a buffer it writes (``g_jump``, ``written``, the final
    states' gradients) not contiguous, tensors not all CPU and of one float dtype, the
    per-step gradients ``(g_y, g_mem)`` not ``(k, B, H)``, a final state's gradient or a
    field wider than a step's or a neuron's."""
    if not (host_loops.USE_JIT and ys.shape[0]) or ys.dim() != 3:
        return None
    if not _writable(g_jump, *written, *g_final):
        return None
    given = [t for t in (*per_step_grads, *g_final) if t is not None]
    arrays = host_loops._host_arrays(ys, slope, g_jump, w_rec, *given, *written)
    if arrays is None or any(t.shape != ys.shape for t in per_step_grads if t is not None):
        return None
    if any(not host_loops._steps_fit(ys[0], t) for t in g_final if t is not None):
        return None
    stacked = _per_neuron(params, ys[0])
    return None if stacked is None else (_rows(ys, arrays[0]), stacked)


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
    written = [t for t in per_step if t is not None]
    fits = _backward_fits(ys, slope, g_jump, w_rec, (g_y, g_mem), g_final, params, written)
    if fits is None:
        return None
    ys_rows, stacked = fits
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
    if modes[0] not in _RESETS or z.shape[1:] != mem0.shape or not fires.is_contiguous():
        return None
    states = (syn0 if syn0 is not None else mem0, mem0)  # (no current: never read)
    kept = (None if mems is None else mems[1:], None if syns is None else syns[1:])
    fields = (b if a is None else a, b, thr, graded)
    run = _compiled(spk0, states, ys, kept, fields, also=(z,))
    if run is None:
        return None
    z_rows, fired = _rows(z, run.ys), fires.numpy().reshape(fires.shape[0], -1)
    step_modes = (syn0 is not None, jit_loops.RESET_CODES[modes[0]], modes[1])
    for t in range(z.shape[0]):
        out = (run.ys[t], run.flat[0], *run.kept_at(t))
        fed = _flat(rec(run.fed_back(t)))
        state = run.flat[1:]
        jit_loops.recurrent_leaky_step_jit(
            z_rows[t], fed, state, fired[t], fired[t + 1], run.stacked, step_modes, out
        )
    syn, mem = run.states
    return run.spk, (syn if syn0 is not None else None), mem


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
    run = _compiled(spk0, (v0, i0, b0), ys, kept, params, also=(weights[1],))
    if run is None:
        return None
    for t, fed, rec in _products(run, z, current, weights):
        out = (run.ys[t], run.flat[0], *run.kept_at(t))
        jit_loops.lsnn_recurrent_step_jit(run.flat[1:], fed, rec, run.stacked, out)
    return [run.spk, *run.states]


def lsnn_recurrent_backward_on_host(
    g_y: Tensor | None,
    g_final: Sequence[Tensor | None],
    g_mem: Tensor | None,
    slope: Tensor,
    ys: Tensor,
    w_rec: Tensor,
    params: tuple[Tensor, Tensor, Tensor],
    g_jump: Tensor,
) -> list[Tensor] | None:
    """Run `NorseLSNNKernel.backward`'s loop from the last step to the first: dL/d each
    step's current jump (the current's carry entering the step) into ``g_jump`` ``(k, B,
    H)``. Returns the gradients of the states before the chunk ``[spikes, membrane, current,
    threshold]``, or None (nothing written) where it does not run.

    Args:
        g_y, g_mem: the spikes' and the membranes' gradients ``(k, B, H)``, or None.
        g_final: the final states' gradients (``[spikes, membrane, current, threshold]``,
            each broadcastable to a step, or None: zeros, as the torch loop starts).
        slope: the surrogate's derivative at each step ``(k, B, H)``; ``ys``: the spikes.
        params: ``(c_m, c_s, c_a)`` (``dt * tau_mem_inv``, ``-dt * tau_syn_inv``, ``dt *
            tau_adapt_inv``).
    """
    k = ys.shape[0]
    fits = _backward_fits(ys, slope, g_jump, w_rec, (g_y, g_mem), g_final, params)
    if fits is None:
        return None
    ys_rows, stacked = fits
    # the torch loop's first product reads the current's carry as given (zeros for None)
    first_i = torch.zeros_like(ys[0]) if g_final[2] is None else g_final[2]
    carry_z, carry_v, carry_i, carry_b = (_flat_copy(t, ys[0]) for t in g_final)
    carries = [t.numpy().reshape(-1) for t in (carry_z, carry_v, carry_i, carry_b)]
    g_y_rows, g_mem_rows, slope_rows = (_rows(t, ys_rows) for t in (g_y, g_mem, slope))
    jump_rows = _rows(g_jump, ys_rows)
    flags = (g_y is not None, g_mem is not None)
    for t in range(k - 1, -1, -1):
        # the product reads the current's carry entering step t (the first: as given)
        carry_z = (first_i if t == k - 1 else carry_i) @ w_rec
        jit_loops.lsnn_recurrent_back_step_jit(
            g_y_rows[t], g_mem_rows[t], flags, tuple(carries), slope_rows[t], ys_rows[t], stacked,
            jump_rows[t],
        )  # fmt: skip
        carries[0] = _writable_flat(carry_z, ys[0])  # the next step's g_s, in place
    return [carry_z, carry_v, carry_i, carry_b]


def _writable_flat(tensor: Tensor, like: Tensor) -> np.ndarray:
    """``tensor`` as a ``(n,)`` array the compiled step may overwrite: a view of it where it
    is contiguous and of ``like``'s shape, else a copy broadcast to that shape."""
    if tensor.shape != like.shape or not tensor.is_contiguous():
        tensor = _flat_copy(tensor, like)
    return tensor.detach().numpy().reshape(-1)
