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

__all__ = ["BLOCK", "leaky_backward_jit", "leaky_forward_jit"]

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


@_jit
def leaky_forward_jit(
    mem: np.ndarray,
    z: np.ndarray,
    decay: np.ndarray,
    thr: np.ndarray,
    subtract: bool,
    out: np.ndarray,
    fired: np.ndarray,
) -> None:  # pragma: no cover - runs compiled
    """The chunk's membranes into ``out`` and spikes into ``fired[1:]``.

    Args:
        mem, decay, thr: ``(n,)`` the membrane before the chunk, its decay and threshold.
        z: ``(k, n)`` the chunk's input.
        subtract: subtract ``thr`` where the previous step fired (else no reset).
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
                v = d[i] * block[i] + step_in[i]
                if subtract:
                    v = v - (th[i] if before[i] else zero)
                block[i] = v
                row[i] = v
                after[i] = v > th[i]


@_jit
def leaky_backward_jit(
    g: np.ndarray, decay: np.ndarray, carry: np.ndarray, has_carry: bool, out: np.ndarray
) -> None:  # pragma: no cover - runs compiled
    """``g[t] += carry; carry = decay * g[t]`` from the last step to the first, in place on
    ``g`` ``(k, n)``; the carry into the state before the chunk goes to ``out`` ``(n,)``.
    ``carry`` ``(n,)`` is read only when ``has_carry``."""
    k, n = g.shape
    block = np.empty(BLOCK, g.dtype)
    for start in range(0, n, BLOCK):
        width = min(BLOCK, n - start)
        stop = start + width
        d = decay[start:stop]
        if has_carry:
            block[:width] = carry[start:stop]
        for t in range(k - 1, -1, -1):
            gt = g[t, start:stop]
            if has_carry or t < k - 1:
                for i in range(width):
                    gt[i] = gt[i] + block[i]
            for i in range(width):
                block[i] = d[i] * gt[i]
        out[start:stop] = block[:width]
