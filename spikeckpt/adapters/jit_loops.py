"""The membrane recurrence of a fused chunk compiled with Numba, for CPU steps of any size.

The NumPy loop (`spikeckpt.adapters.host_loops`) still makes four ufunc calls per time step,
each a full pass over the step's neurons. Here the chunk runs as one compiled function that
walks the neurons in blocks of `BLOCK` and, inside a block, every step of the chunk: the
membrane stays in a block-sized buffer in the L1 cache and each input, membrane and spike is
touched once. Each element sees the same IEEE operations in the same order as the torch loop
(a multiply, an add, a subtract of the threshold or of zero, a compare; Numba compiles without
``fastmath``, so nothing is fused or reordered): spikes, membranes and gradients are bitwise the
torch loop's.

Compiling costs about half a second per dtype, once: the machine code is cached on disk
(Numba's ``cache=True``: ``__pycache__`` beside this file, or the user's cache folder where that
is read-only). Without Numba these functions are None and the NumPy loop runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "BLOCK",
    "RESET_CODES",
    "leaky_backward_jit",
    "leaky_forward_jit",
    "synaptic_backward_jit",
    "synaptic_forward_jit",
]

#: neurons per block: the block's membranes, decays and thresholds (3 x 1 KiB in float32) stay
#: in the L1 cache while the chunk's steps run over them
BLOCK = 256

try:  # pragma: no branch - numba is a dependency; a platform without its wheels runs NumPy
    import numba
except ImportError:  # pragma: no cover
    numba = None


def _jit(function: Callable[..., Any]) -> Any:
    """``function`` compiled (lazily, per dtype, cached on disk), or None without Numba."""
    if numba is None:  # pragma: no cover
        return None
    return numba.njit(cache=True, nogil=True, boundscheck=False)(function)


#: reset codes of the compiled loops: none, subtract ``thr``, to zero after the step's input
#: (snnTorch's ``"zero"``), to zero before it (the membrane a spike leaves behind is zero)
RESET_CODES = {"none": 0, "subtract": 1, "zero_after": 2, "zero_before": 3}


@_jit
def leaky_forward_jit(
    mem: np.ndarray,
    z: np.ndarray,
    decay: np.ndarray,
    thr: np.ndarray,
    reset: int,
    out: np.ndarray,
    fired: np.ndarray,
) -> None:  # pragma: no cover - runs compiled
    """The chunk's membranes into ``out`` and spikes into ``fired[1:]``: the torch loop's
    ``decay * pre + z_t`` and reset, each the same operation (``where(f, thr, thr * 0)``,
    ``base - f * base``, ``where(f, mem * 0, mem)``).

    Args:
        mem, decay, thr: ``(n,)`` the membrane before the chunk, its decay and threshold.
        z: ``(k, n)`` the chunk's input.
        reset: a `RESET_CODES` value.
        out: ``(rows, n)``: step ``t``'s membrane goes to row ``(t + 1) % rows`` (one row: the
            last membrane only; ``k + 1`` rows: all, row 0 untouched). Rows 1.. may be ``z``'s
            own memory: each element is read before it is written.
        fired: ``(k + 1, n)`` bool; row 0 holds the reset of step 0.
    """
    k, n = z.shape
    rows = out.shape[0]
    block = np.empty(BLOCK, mem.dtype)
    step_in = np.empty(BLOCK, mem.dtype)
    zero = mem.dtype.type(0)
    one = mem.dtype.type(1)
    for start in range(0, n, BLOCK):
        width = min(BLOCK, n - start)
        stop = start + width
        block[:width] = mem[start:stop]
        d = decay[start:stop]
        th = thr[start:stop]
        for t in range(k):
            # the input first (``out`` may be ``z``'s memory: read before written, and the
            # loop below, free of that overlap, runs vectorized)
            zt = z[t, start:stop]
            for i in range(width):
                step_in[i] = zt[i]
            row = out[(t + 1) % rows, start:stop]
            before = fired[t, start:stop]
            after = fired[t + 1, start:stop]
            for i in range(width):
                m = block[i]
                if reset == 3:
                    m = m * zero if before[i] else m
                v = d[i] * m + step_in[i]
                if reset == 1:
                    v = v - (th[i] if before[i] else th[i] * zero)
                elif reset == 2:
                    v = v - (one if before[i] else zero) * v
                block[i] = v
                row[i] = v
                after[i] = v > th[i]


@_jit
def leaky_backward_jit(
    g: np.ndarray,
    decay: np.ndarray,
    carry: np.ndarray,
    has_carry: bool,
    out: np.ndarray,
    fired: np.ndarray,
    reset: int,
) -> None:  # pragma: no cover - runs compiled
    """``g[t] += carry; carry = decay * g[t]`` from the last step to the first, in place on
    ``g`` ``(k, n)``; the carry into the state before the chunk goes to ``out`` ``(n,)``.
    ``carry`` ``(n,)`` is read only when ``has_carry``. The zero resets keep ``(1 - r_t)``
    from ``fired`` ``(k + 1, n)`` (row ``t`` is step ``t``'s reset): after the input it
    multiplies ``g[t]`` before the decay, before the input the carry after it."""
    k, n = g.shape
    block = np.empty(BLOCK, g.dtype)
    zero = g.dtype.type(0)
    one = g.dtype.type(1)
    for start in range(0, n, BLOCK):
        width = min(BLOCK, n - start)
        stop = start + width
        d = decay[start:stop]
        if has_carry:
            block[:width] = carry[start:stop]
        for t in range(k - 1, -1, -1):
            gt = g[t, start:stop]
            reset_t = fired[t, start:stop]
            if has_carry or t < k - 1:
                for i in range(width):
                    gt[i] = gt[i] + block[i]
            for i in range(width):
                base = gt[i]
                if reset == 2:
                    base = base * (zero if reset_t[i] else one)
                c = d[i] * base
                if reset == 3:
                    c = c * (zero if reset_t[i] else one)
                block[i] = c
        out[start:stop] = block[:width]


@_jit
def synaptic_forward_jit(
    syn: np.ndarray,
    mem: np.ndarray,
    z: np.ndarray,
    alpha: np.ndarray,
    beta: np.ndarray,
    thr: np.ndarray,
    reset: int,
    syns: np.ndarray,
    mems: np.ndarray,
    fired: np.ndarray,
) -> None:  # pragma: no cover - runs compiled
    """snnTorch ``Synaptic``'s chunk: ``syn_t = alpha * syn + z_t``, ``base = beta * mem +
    syn_t``, the reset (``"none"``, ``"subtract"`` or ``"zero_after"``), the spike
    ``mem_t > thr``; the torch loop's operations in its order.

    Args:
        syn, mem, alpha, beta, thr: ``(n,)`` the states before the chunk, the (clamped)
            decays and the threshold.
        z: ``(k, n)`` the chunk's input.
        reset: a `RESET_CODES` value.
        syns, mems: ``(rows, n)``: step ``t``'s states go to row ``(t + 1) % rows``.
        fired: ``(k + 1, n)`` bool; row 0 holds the reset of step 0.
    """
    k, n = z.shape
    rows = mems.shape[0]
    current = np.empty(BLOCK, mem.dtype)
    membrane = np.empty(BLOCK, mem.dtype)
    step_in = np.empty(BLOCK, mem.dtype)
    zero = mem.dtype.type(0)
    one = mem.dtype.type(1)
    for start in range(0, n, BLOCK):
        width = min(BLOCK, n - start)
        stop = start + width
        current[:width] = syn[start:stop]
        membrane[:width] = mem[start:stop]
        a = alpha[start:stop]
        b = beta[start:stop]
        th = thr[start:stop]
        for t in range(k):
            zt = z[t, start:stop]
            for i in range(width):
                step_in[i] = zt[i]
            syn_row = syns[(t + 1) % rows, start:stop]
            mem_row = mems[(t + 1) % rows, start:stop]
            before = fired[t, start:stop]
            after = fired[t + 1, start:stop]
            for i in range(width):
                s = a[i] * current[i] + step_in[i]
                v = b[i] * membrane[i] + s
                if reset == 1:
                    v = v - (th[i] if before[i] else th[i] * zero)
                elif reset == 2:
                    v = v - v * (one if before[i] else zero)
                current[i] = s
                membrane[i] = v
                syn_row[i] = s
                mem_row[i] = v
                after[i] = v > th[i]


@_jit
def synaptic_backward_jit(
    g_mem: np.ndarray,
    g_syn: np.ndarray,
    alpha: np.ndarray,
    beta: np.ndarray,
    fired: np.ndarray,
    reset: int,
    carry_mem: np.ndarray,
    has_mem: bool,
    carry_syn: np.ndarray,
    has_syn: bool,
) -> None:  # pragma: no cover - runs compiled
    """The Synaptic chunk's backward from the last step to the first: ``g_mem[t] += carry``
    (in place: dL/d mem_t), ``g_syn[t]`` (written: dL/d syn_t), and the carries into the states
    before the chunk left in ``carry_mem`` / ``carry_syn`` ``(n,)`` (read first only where
    ``has_mem`` / ``has_syn``). ``"zero_after"`` multiplies by ``1 - r_t`` (``fired[t]``)."""
    k, n = g_mem.shape
    c_mem = np.empty(BLOCK, g_mem.dtype)
    c_syn = np.empty(BLOCK, g_mem.dtype)
    zero = g_mem.dtype.type(0)
    one = g_mem.dtype.type(1)
    for start in range(0, n, BLOCK):
        width = min(BLOCK, n - start)
        stop = start + width
        a = alpha[start:stop]
        b = beta[start:stop]
        if has_mem:
            c_mem[:width] = carry_mem[start:stop]
        if has_syn:
            c_syn[:width] = carry_syn[start:stop]
        for t in range(k - 1, -1, -1):
            gm = g_mem[t, start:stop]
            gs = g_syn[t, start:stop]
            reset_t = fired[t, start:stop]
            add_mem = has_mem or t < k - 1
            add_syn = has_syn or t < k - 1
            for i in range(width):
                if add_mem:
                    gm[i] = gm[i] + c_mem[i]
                base = gm[i]
                if reset == 2:
                    base = base * (zero if reset_t[i] else one)
                c_mem[i] = b[i] * base
                v = base + c_syn[i] if add_syn else base
                gs[i] = v
                c_syn[i] = a[i] * v
        carry_mem[start:stop] = c_mem[:width]
        carry_syn[start:stop] = c_syn[:width]
