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

import numpy as np

from spikeckpt.numba_jit import jit

__all__ = [
    "BLOCK",
    "RESET_CODES",
    "leaky_backward_jit",
    "leaky_forward_jit",
    "lif_recurrent_back_carried_jit",
    "lif_recurrent_back_step_jit",
    "lif_recurrent_step_jit",
    "lsnn_recurrent_back_step_jit",
    "lsnn_recurrent_step_jit",
    "norse_backward_lean_jit",
    "norse_forward_pre_jit",
    "recurrent_leaky_step_jit",
    "synaptic_backward_jit",
    "synaptic_forward_jit",
]

#: neurons per block: the block's membranes, decays and thresholds (3 x 1 KiB in float32) stay
#: in the L1 cache while the chunk's steps run over them
BLOCK = 256

_jit = jit  # the library's njit (`spikeckpt.numba_jit`)


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
    carries: tuple[np.ndarray, np.ndarray],
    has: tuple[bool, bool, bool],
    given: np.ndarray,
) -> None:  # pragma: no cover - runs compiled
    """The Synaptic chunk's backward from the last step to the first: ``g_mem[t] += carry``
    (in place: dL/d mem_t), ``g_syn[t]`` (written: dL/d syn_t, ``given[t]`` added where
    ``has[2]``: the current's own per-step gradient), and the carries into the states before
    the chunk left in ``carries = (carry_mem, carry_syn)`` ``(n,)`` (read first only where
    ``has[0]`` / ``has[1]``). ``"zero_after"`` multiplies by ``1 - r_t`` (``fired[t]``)."""
    carry_mem, carry_syn = carries
    has_mem, has_syn, has_given = has
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
            extra = given[t, start:stop]
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
                if has_given:
                    v = v + extra[i]
                gs[i] = v
                c_syn[i] = a[i] * v
        carry_mem[start:stop] = c_mem[:width]
        carry_syn[start:stop] = c_syn[:width]


#: Norse's feed-forward steps (`spikeckpt.adapters.kernels.NorseKernel`'s modes)
NORSE_MODES = {"lif": 0, "box": 1, "li": 2}


@_jit
def norse_forward_jit(
    v0: np.ndarray,
    i0: np.ndarray,
    z: np.ndarray,
    params: np.ndarray,
    mode: int,
    subtract: bool,
    vs: np.ndarray,
    is_: np.ndarray,
    y: np.ndarray,
) -> None:  # pragma: no cover - runs compiled
    """Norse's ``lif`` / ``box`` / ``li`` feed-forward step over a chunk, the kernel's torch
    operations in their order (`NorseKernel.forward`).

    Args:
        v0, i0: ``(n,)`` the states before the chunk (``i0`` unread for ``box``).
        z: ``(k, n)`` the chunk's input.
        params: ``(5, n)``: ``dt * tau_mem_inv``, ``v_leak``, ``v_th``, ``v_reset``,
            ``-dt * tau_syn_inv`` (rows a mode does not use are unread).
        mode: a `NORSE_MODES` value; ``subtract``: ``box``'s ``reset_subtract``.
        vs, is_: ``(rows, n)``: step ``t``'s states go to row ``(t + 1) % rows``.
        y: ``(k, n)`` the spikes (``li``: the membranes).
    """
    k, n = z.shape
    rows = vs.shape[0]
    v = np.empty(BLOCK, v0.dtype)
    cur = np.empty(BLOCK, v0.dtype)
    step_in = np.empty(BLOCK, v0.dtype)
    zero = v0.dtype.type(0)
    one = v0.dtype.type(1)
    for start in range(0, n, BLOCK):
        width = min(BLOCK, n - start)
        stop = start + width
        v[:width] = v0[start:stop]
        if mode != 1:
            cur[:width] = i0[start:stop]
        c_m = params[0, start:stop]
        leak = params[1, start:stop]
        th = params[2, start:stop]
        v_reset = params[3, start:stop]
        c_s = params[4, start:stop]
        for t in range(k):
            zt = z[t, start:stop]
            for j in range(width):
                step_in[j] = zt[j]
            v_row = vs[(t + 1) % rows, start:stop]
            i_row = is_[(t + 1) % rows, start:stop]
            out = y[t, start:stop]
            for j in range(width):
                if mode == 1:
                    w = v[j] + c_m[j] * ((step_in[j] + leak[j]) - v[j])
                else:
                    c = cur[j] + step_in[j]
                    w = v[j] + c_m[j] * ((leak[j] - v[j]) + c)
                    c = c + c_s[j] * c
                    cur[j] = c
                    i_row[j] = c
                if mode == 2:
                    out[j] = w
                else:
                    s = one if w - th[j] > zero else zero
                    out[j] = s
                    if subtract:
                        w = (one - s) * w + s * (w - th[j])
                    else:
                        w = (one - s) * w + s * v_reset[j]
                v[j] = w
                v_row[j] = w


@_jit
def norse_forward_pre_jit(
    v0: np.ndarray,
    i0: np.ndarray,
    z: np.ndarray,
    params: np.ndarray,
    mode: int,
    subtract: bool,
    vs: np.ndarray,
    is_: np.ndarray,
    y: np.ndarray,
    pre: np.ndarray,
) -> None:  # pragma: no cover - runs compiled
    """`norse_forward_jit` that also keeps each step's membrane before its reset in ``pre``
    (a loop of its own: a store that may be skipped, or ``pre`` aliasing ``y``, made the
    vectorized loop give way to a scalar one, 1.5-3x slower).

    Args:
        v0, i0: ``(n,)`` the states before the chunk (``i0`` unread for ``box``).
        z: ``(k, n)`` the chunk's input.
        params: ``(5, n)``: ``dt * tau_mem_inv``, ``v_leak``, ``v_th``, ``v_reset``,
            ``-dt * tau_syn_inv`` (rows a mode does not use are unread).
        mode: a `NORSE_MODES` value; ``subtract``: ``box``'s ``reset_subtract``.
        vs, is_: ``(rows, n)``: step ``t``'s states go to row ``(t + 1) % rows``.
        y: ``(k, n)`` the spikes (``li``: the membranes), or one row that each step
            overwrites (unread after).
        pre: ``(k, n)`` each step's membrane before its reset (it may be ``z`` itself:
            each row is read before it is written).
    """
    k, n = z.shape
    rows = vs.shape[0]
    y_rows = y.shape[0]
    v = np.empty(BLOCK, v0.dtype)
    cur = np.empty(BLOCK, v0.dtype)
    step_in = np.empty(BLOCK, v0.dtype)
    zero = v0.dtype.type(0)
    one = v0.dtype.type(1)
    for start in range(0, n, BLOCK):
        width = min(BLOCK, n - start)
        stop = start + width
        v[:width] = v0[start:stop]
        if mode != 1:
            cur[:width] = i0[start:stop]
        c_m = params[0, start:stop]
        leak = params[1, start:stop]
        th = params[2, start:stop]
        v_reset = params[3, start:stop]
        c_s = params[4, start:stop]
        for t in range(k):
            zt = z[t, start:stop]
            for j in range(width):
                step_in[j] = zt[j]
            v_row = vs[(t + 1) % rows, start:stop]
            i_row = is_[(t + 1) % rows, start:stop]
            out = y[t % y_rows, start:stop]
            before = pre[t, start:stop]
            for j in range(width):
                if mode == 1:
                    w = v[j] + c_m[j] * ((step_in[j] + leak[j]) - v[j])
                else:
                    c = cur[j] + step_in[j]
                    w = v[j] + c_m[j] * ((leak[j] - v[j]) + c)
                    c = c + c_s[j] * c
                    cur[j] = c
                    i_row[j] = c
                before[j] = w
                if mode == 2:
                    out[j] = w
                else:
                    s = one if w - th[j] > zero else zero
                    out[j] = s
                    if subtract:
                        w = (one - s) * w + s * (w - th[j])
                    else:
                        w = (one - s) * w + s * v_reset[j]
                v[j] = w
                v_row[j] = w


@_jit
def norse_backward_jit(
    v_d: np.ndarray,
    y: np.ndarray,
    deriv: np.ndarray,
    has_deriv: bool,
    g_y: np.ndarray,
    has_g_y: bool,
    g_mem: np.ndarray,
    has_g_mem: bool,
    params: np.ndarray,
    mode: int,
    subtract: bool,
    carry_v: np.ndarray,
    has_v: bool,
    carry_i: np.ndarray,
    has_i: bool,
    g_vd: np.ndarray,
    g_u: np.ndarray,
    g_in: np.ndarray,
    g_vn_all: np.ndarray,
) -> None:  # pragma: no cover - runs compiled
    """`NorseKernel.backward`'s loop from the last step to the first, its operations in their
    order: fills ``g_vd``, ``g_u`` (not ``li``), ``g_in`` (not ``box``) and ``g_vn_all``
    (each ``(k, n)``) and leaves the carries into the states before the chunk in ``carry_v`` /
    ``carry_i`` ``(n,)`` (read first only where ``has_v`` / ``has_i``).

    Args:
        v_d, y, deriv, g_y, g_mem: ``(k, n)``: the membranes before the reset, the outputs,
            the surrogate's derivative, the outputs' and the membranes' gradients (the last
            three read only where ``has_...``).
        params: ``(5, n)``: ``v_th``, ``v_reset``, ``1 - c_m``, ``c_m``, ``1 + c_s``.
    """
    k, n = v_d.shape
    gv = np.empty(BLOCK, v_d.dtype)
    gi = np.empty(BLOCK, v_d.dtype)
    zero = v_d.dtype.type(0)
    one = v_d.dtype.type(1)
    for start in range(0, n, BLOCK):
        width = min(BLOCK, n - start)
        stop = start + width
        th = params[0, start:stop]
        v_reset = params[1, start:stop]
        one_minus_cm = params[2, start:stop]
        c_m = params[3, start:stop]
        keep_i = params[4, start:stop]
        if has_v:
            gv[:width] = carry_v[start:stop]
        if has_i:
            gi[:width] = carry_i[start:stop]
        for t in range(k - 1, -1, -1):
            carried_v = has_v or t < k - 1
            carried_i = has_i or t < k - 1
            vd = v_d[t, start:stop]
            yt = y[t, start:stop]
            dr = deriv[t, start:stop]
            gy = g_y[t, start:stop]
            gm = g_mem[t, start:stop]
            out_vd = g_vd[t, start:stop]
            out_u = g_u[t, start:stop]
            out_in = g_in[t, start:stop]
            out_vn = g_vn_all[t, start:stop]
            for j in range(width):
                g_vn = gv[j] if carried_v else zero
                if has_g_mem:
                    g_vn = g_vn + gm[j] if carried_v else gm[j]
                out_vn[j] = g_vn
                if mode == 2:
                    g_here = g_vn + gy[j] if has_g_y else g_vn
                else:
                    ds = g_vn * (-th[j] if subtract else v_reset[j] - vd[j])
                    if has_g_y:
                        ds = ds + gy[j]
                    g_s = ds * dr[j] if has_deriv else zero
                    out_u[j] = g_s
                    g_here = (g_vn if subtract else g_vn * (one - yt[j])) + g_s
                out_vd[j] = g_here
                gv[j] = g_here * one_minus_cm[j]
                if mode != 1:
                    g_new = c_m[j] * g_here
                    if carried_i:
                        g_new = g_new + gi[j] * keep_i[j]
                    out_in[j] = g_new
                    gi[j] = g_new
        carry_v[start:stop] = gv[:width]
        carry_i[start:stop] = gi[:width]


#: the spike's slope in `norse_backward_lean_jit`: none (a spike without gradient), Norse's
#: SuperSpike (``1 / (abs(u) + 1)^2`` at ``u = v - v_th``, its backward for a gradient of ones)
NORSE_SLOPES = {"none": 0, "super": 1}


@_jit
def norse_backward_lean_jit(
    pre: np.ndarray,
    g_y: np.ndarray,
    has_g_y: bool,
    g_mem: np.ndarray,
    has_g_mem: bool,
    params: np.ndarray,
    slope: int,
    mode: int,
    subtract: bool,
    carry_v: np.ndarray,
    has_v: bool,
    carry_i: np.ndarray,
    has_i: bool,
    g_z: np.ndarray,
) -> None:  # pragma: no cover - runs compiled
    """`norse_backward_jit` where no parameter field needs a gradient, from the membranes
    before each reset alone: the spike and the surrogate's slope are taken from them in the
    loop (the kernel's and Norse's operations, in their order) and only ``dL/dz`` comes out,
    into ``g_z`` ``(k, n)``, which may be ``pre`` itself (each row is read before it is
    written). The carries into the states before the chunk go to ``carry_v`` / ``carry_i``
    as there.

    Args:
        pre: ``(k, n)`` the membranes before the reset (unread for ``li``).
        g_y, g_mem: ``(k, n)`` the outputs' and the membranes' gradients (read where
            ``has_...``).
        params: ``(5, n)``: ``v_th``, ``v_reset``, ``1 - c_m``, ``c_m``, ``1 + c_s``.
        slope: a `NORSE_SLOPES` value.
    """
    k, n = g_z.shape
    gv = np.empty(BLOCK, g_z.dtype)
    gi = np.empty(BLOCK, g_z.dtype)
    zero = g_z.dtype.type(0)
    one = g_z.dtype.type(1)
    for start in range(0, n, BLOCK):
        width = min(BLOCK, n - start)
        stop = start + width
        th = params[0, start:stop]
        v_reset = params[1, start:stop]
        one_minus_cm = params[2, start:stop]
        c_m = params[3, start:stop]
        keep_i = params[4, start:stop]
        if has_v:
            gv[:width] = carry_v[start:stop]
        if has_i:
            gi[:width] = carry_i[start:stop]
        for t in range(k - 1, -1, -1):
            carried_v = has_v or t < k - 1
            carried_i = has_i or t < k - 1
            vd = pre[t, start:stop]
            gy = g_y[t, start:stop]
            gm = g_mem[t, start:stop]
            out = g_z[t, start:stop]
            for j in range(width):
                g_vn = gv[j] if carried_v else zero
                if has_g_mem:
                    g_vn = g_vn + gm[j] if carried_v else gm[j]
                if mode == 2:
                    g_here = g_vn + gy[j] if has_g_y else g_vn
                else:
                    w = vd[j]
                    ds = g_vn * (-th[j] if subtract else v_reset[j] - w)
                    if has_g_y:
                        ds = ds + gy[j]
                    g_s = zero
                    if slope == 1:
                        u = abs(w - th[j]) + one
                        g_s = ds * (one / (u * u))
                    s = one if w - th[j] > zero else zero
                    g_here = (g_vn if subtract else g_vn * (one - s)) + g_s
                gv[j] = g_here * one_minus_cm[j]
                g_new = c_m[j] * g_here
                if mode != 1:
                    if carried_i:
                        g_new = g_new + gi[j] * keep_i[j]
                    gi[j] = g_new
                out[j] = g_new
        carry_v[start:stop] = gv[:width]
        carry_i[start:stop] = gi[:width]


@_jit
def lif_recurrent_step_jit(
    i: np.ndarray,
    fed: np.ndarray,
    rec: np.ndarray,
    v: np.ndarray,
    params: np.ndarray,
    spk: np.ndarray,
    y: np.ndarray,
    kept: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> None:  # pragma: no cover - runs compiled
    """One step of Norse's ``lif_step`` after its two products, the operations of
    `NorseRecurrentKernel.forward` in their order: ``j = (i + fed) + rec``, ``v_d = v + c_m *
    ((v_leak - v) + j)``, ``i = j + c_s * j``, ``s = (v_d - v_th > 0)``, ``v = (1 - s) * v_d +
    s * v_reset``; ``i`` and ``v`` in place, the spikes into ``spk`` and ``y``.

    Args:
        i, fed, rec, v, spk, y: ``(n,)`` (``n = B * H``): the current, the input's and the
            fed-back spikes' products, the membrane, the spikes (twice: the step's row of
            the chunk's spikes, and the tensor fed back).
        params: ``(5, H)``: ``dt * tau_mem_inv``, ``v_leak``, ``v_th``, ``v_reset``, ``-dt *
            tau_syn_inv``.
        kept: ``(n,)`` each, the membrane before the reset, after it, the drive ``(v_leak -
            v) + j`` and the jump ``j``: four distinct arrays, written unconditionally (a
            branch per element, or two outputs sharing memory, keep the loop from running
            vectorized: 2-2.5x slower, measured).
    """
    zero = v.dtype.type(0)
    one = v.dtype.type(1)
    h = params.shape[1]
    c_m, leak, th, v_reset, c_s = params[0], params[1], params[2], params[3], params[4]
    for start in range(0, v.shape[0], h):
        stop = start + h
        i_b, fed_b, rec_b, v_b = i[start:stop], fed[start:stop], rec[start:stop], v[start:stop]
        spk_b, y_b = spk[start:stop], y[start:stop]
        vd_b, after_b = kept[0][start:stop], kept[1][start:stop]
        drive_b, jump_b = kept[2][start:stop], kept[3][start:stop]
        for c in range(h):
            jump = (i_b[c] + fed_b[c]) + rec_b[c]
            drive = (leak[c] - v_b[c]) + jump
            w = v_b[c] + c_m[c] * drive
            i_b[c] = jump + c_s[c] * jump
            s = one if w - th[c] > zero else zero
            after = (one - s) * w + s * v_reset[c]
            v_b[c] = after
            spk_b[c] = s
            y_b[c] = s
            vd_b[c] = w
            after_b[c] = after
            drive_b[c] = drive
            jump_b[c] = jump


@_jit
def lif_recurrent_back_carried_jit(
    g_y: np.ndarray,
    has_y: bool,
    g_mem: np.ndarray,
    has_mem: bool,
    carries: tuple[np.ndarray, np.ndarray, np.ndarray],
    slope: np.ndarray,
    y: np.ndarray,
    params: np.ndarray,
    g_jump: np.ndarray,
    g_j: np.ndarray,
) -> None:  # pragma: no cover - runs compiled
    """One step of `NorseRecurrentKernel.backward`'s loop before its product with the
    recurrent weight, where every carry is given (each step but a chunk's last, whose
    carries may be None: `lif_recurrent_back_step_jit`) and no parameter reads the per-step
    terms: ``g_s = g_y + carry_z``, ``g_v = g_mem + carry_v`` (in place, where given), ``g_vd
    = slope * g_s + g_v * (1 - y)``, ``g_j = g_vd * c_m + (carry_i + carry_i * c_s)``, then
    ``carry_v = g_vd - g_vd * c_m``, ``carry_i = g_j`` in place and ``g_j`` into ``g_jump``
    and ``g_j``: the torch loop's operations in their order.

    Args:
        g_y, g_mem, slope, y, g_jump, g_j: ``(n,)``, the step's rows.
        carries: ``(carry_z, carry_v, carry_i)``, ``(n,)`` each.
        params: ``(2, H)``: ``c_m``, ``c_s``.
    """
    one = y.dtype.type(1)
    carry_z, carry_v, carry_i = carries
    n, h = y.shape[0], params.shape[1]
    if has_y:
        for j in range(n):
            carry_z[j] = g_y[j] + carry_z[j]
    if has_mem:
        for j in range(n):
            carry_v[j] = g_mem[j] + carry_v[j]
    c_m, c_s = params[0], params[1]
    for start in range(0, n, h):
        stop = start + h
        g_s, g_v, g_i = carry_z[start:stop], carry_v[start:stop], carry_i[start:stop]
        slope_b, y_b, jump_b, g_b = (
            slope[start:stop],
            y[start:stop],
            g_jump[start:stop],
            g_j[start:stop],
        )
        for c in range(h):
            g_vd = slope_b[c] * g_s[c]
            g_vd = g_vd + g_v[c] * (one - y_b[c])
            g = g_vd * c_m[c]
            g = g + (g_i[c] + g_i[c] * c_s[c])
            g_v[c] = g_vd - g_vd * c_m[c]
            g_i[c] = g
            jump_b[c] = g
            g_b[c] = g


@_jit
def lif_recurrent_back_step_jit(
    t: int,
    g_y: np.ndarray,
    carry_z: np.ndarray,
    g_mem: np.ndarray,
    carry_v: np.ndarray,
    carry_i: np.ndarray,
    given: np.ndarray,
    slope: np.ndarray,
    ys: np.ndarray,
    params: np.ndarray,
    g_jump: np.ndarray,
    g_j: np.ndarray,
    g_vds: np.ndarray,
    g_is: np.ndarray,
    g_vs: np.ndarray,
    g_ss: np.ndarray,
    reads: np.ndarray,
) -> None:  # pragma: no cover - runs compiled
    """Step ``t`` of `NorseRecurrentKernel.backward`'s loop before its product with the
    recurrent weight, its operations in their order: ``g_s = g_y[t] + carry_z``, ``g_v =
    g_mem[t] + carry_v``, ``g_vd = slope[t] * g_s + g_v * (1 - ys[t])``, ``g_j = g_vd * c_m +
    (carry_i + carry_i * c_s)``, then ``carry_v = g_vd - g_vd * c_m``, ``carry_i = g_j``
    (in place) and ``g_j`` into ``g_jump[t]`` and ``g_j``.

    Args:
        g_y, g_mem, slope, ys, g_jump: ``(k, n)``; carry_z, carry_v, carry_i, g_j: ``(n,)``.
        given: ``(5,)`` bool: whether ``g_y``, ``carry_z``, ``g_mem``, ``carry_v`` and
            ``carry_i`` hold values (a term that is not given is left out, as the torch loop
            leaves out a None; no spike gradient at all: ``g_vd`` starts from zero).
        params: ``(2, H)``: ``c_m``, ``c_s`` (``n = B * H``).
        g_vds, g_is, g_vs, g_ss: ``(k, n)``: row ``t`` of dL/d v_d, of the current's carry,
            of ``g_v`` and of ``g_s``, each written where ``reads`` (``(4,)`` bool) says and
            its value is given (else any array: unread).
    """
    n, h = ys.shape[1], params.shape[1]
    zero = ys.dtype.type(0)
    one = ys.dtype.type(1)
    has_y, has_z, has_mem, has_v, has_i = given[0], given[1], given[2], given[3], given[4]
    has_s = has_y or has_z
    has_gv = has_mem or has_v
    for j in range(n):
        g_s = zero
        if has_y:
            g_s = g_y[t, j] + carry_z[j] if has_z else g_y[t, j]
        elif has_z:
            g_s = carry_z[j]
        g_v = zero
        if has_mem:
            g_v = g_mem[t, j] + carry_v[j] if has_v else g_mem[t, j]
        elif has_v:
            g_v = carry_v[j]
        g_vd = slope[t, j] * g_s if has_s else zero
        if has_gv:
            g_vd = g_vd + g_v * (one - ys[t, j])
        c_m, c_s = params[0, j % h], params[1, j % h]
        g = g_vd * c_m
        if has_i:
            g = g + (carry_i[j] + carry_i[j] * c_s)
        if reads[0]:
            g_vds[t, j] = g_vd
        if reads[1] and has_i:
            g_is[t, j] = carry_i[j]
        if reads[2] and has_gv:
            g_vs[t, j] = g_v
        if reads[3] and has_s:
            g_ss[t, j] = g_s
        carry_v[j] = g_vd - g_vd * c_m
        carry_i[j] = g
        g_jump[t, j] = g
        g_j[j] = g


@_jit
def recurrent_leaky_step_jit(
    z: np.ndarray,
    rec: np.ndarray,
    state: tuple[np.ndarray, np.ndarray],
    fired: np.ndarray,
    fires: np.ndarray,
    params: np.ndarray,
    modes: tuple[bool, int, bool],
    out: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> None:  # pragma: no cover - runs compiled
    """One step of snnTorch's ``RLeaky`` / ``RSynaptic`` after the recurrent product, the
    operations of `RecurrentKernel.forward` in their order: ``RSynaptic``'s current ``syn =
    (a * syn + z) + rec`` and ``base = b * mem + syn``, else ``base = (b * mem + z) + rec``;
    the reset (``base - where(f, thr, thr * 0)``, ``base - f * base`` or none); the spike
    ``mem > thr`` (``exact``; else ``mem - thr > 0``) times the graded factor.

    Args:
        z, rec: ``(n,)`` (``n = B * H``) the step's input and the fed-back spikes' product.
        state: ``(syn, mem)`` ``(n,)``, in place (``syn`` unread without a current).
        fired, fires: ``(n,)`` bool: the reset entering the step, the step's spikes (out).
        params: ``(4, H)``: ``a`` (the current's decay), ``b``, ``thr``, ``graded``.
        modes: ``(synaptic, reset code, exact)`` (`RESET_CODES`: 0 none, 1 subtract, 2 zero
            after).
        out: ``(n,)`` each: the spikes (the chunk's row and the tensor fed back), the
            membrane's and the current's rows: distinct arrays, written unconditionally.
    """
    synaptic, reset, exact = modes
    syn, mem = state
    y, spk, mem_row, syn_row = out
    zero = mem.dtype.type(0)
    one = mem.dtype.type(1)
    h = params.shape[1]
    a, b, thr, graded = params[0], params[1], params[2], params[3]
    for start in range(0, mem.shape[0], h):
        stop = start + h
        z_b, rec_b, syn_b, mem_b = z[start:stop], rec[start:stop], syn[start:stop], mem[start:stop]
        before, after = fired[start:stop], fires[start:stop]
        y_b, spk_b = y[start:stop], spk[start:stop]
        m_b, s_b = mem_row[start:stop], syn_row[start:stop]
        for c in range(h):
            if synaptic:
                current = (a[c] * syn_b[c] + z_b[c]) + rec_b[c]
                syn_b[c] = current
                s_b[c] = current
                base = b[c] * mem_b[c] + current
            else:
                base = (b[c] * mem_b[c] + z_b[c]) + rec_b[c]
            if reset == 1:
                m = base - (thr[c] if before[c] else thr[c] * zero)
            elif reset == 2:
                m = base - (one if before[c] else zero) * base
            else:
                m = base
            fire = m > thr[c] if exact else m - thr[c] > zero
            s = (one if fire else zero) * graded[c]
            after[c] = fire
            mem_b[c] = m
            m_b[c] = m
            y_b[c] = s
            spk_b[c] = s


@_jit
def lsnn_recurrent_step_jit(
    state: tuple[np.ndarray, np.ndarray, np.ndarray],
    fed: np.ndarray,
    rec: np.ndarray,
    params: np.ndarray,
    out: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> None:  # pragma: no cover - runs compiled
    """One step of Norse's ``lsnn_step`` beside its two products, the operations of
    `NorseLSNNKernel.forward` in their order: ``v_d = v + c_m * ((v_leak - v) + i)``, ``i_d =
    i + c_s * i``, ``b_d = b + c_a * (v_th - b)``, ``u = v_d - b_d``, ``s = (u > 0)``, ``v =
    (1 - s) * v_d + s * v_reset``, ``i = (i_d + fed) + rec``, ``b = b_d + s * beta``.

    Args:
        state: ``(v, i, b)`` ``(n,)`` each (``n = B * H``), in place.
        fed, rec: ``(n,)`` the input's and the previous spikes' products.
        params: ``(7, H)``: ``c_m``, ``c_s``, ``c_a``, ``v_leak``, ``v_th``, ``v_reset``,
            ``beta``.
        out: ``(n,)`` each: the spikes (the chunk's row and the tensor fed back), ``u`` and
            the membrane after the reset: distinct arrays, written unconditionally.
    """
    v, i, b = state
    y, spk, u_row, v_row = out
    zero = v.dtype.type(0)
    one = v.dtype.type(1)
    h = params.shape[1]
    c_m, c_s, c_a, leak, th = params[0], params[1], params[2], params[3], params[4]
    v_reset, beta = params[5], params[6]
    for start in range(0, v.shape[0], h):
        stop = start + h
        v_b, i_b, b_b = v[start:stop], i[start:stop], b[start:stop]
        fed_b, rec_b = fed[start:stop], rec[start:stop]
        y_b, spk_b = y[start:stop], spk[start:stop]
        u_b, vr_b = u_row[start:stop], v_row[start:stop]
        for c in range(h):
            v_d = v_b[c] + c_m[c] * ((leak[c] - v_b[c]) + i_b[c])
            i_d = i_b[c] + c_s[c] * i_b[c]
            b_d = b_b[c] + c_a[c] * (th[c] - b_b[c])
            u = v_d - b_d
            s = one if u > zero else zero
            after = (one - s) * v_d + s * v_reset[c]
            v_b[c] = after
            i_b[c] = (i_d + fed_b[c]) + rec_b[c]
            b_b[c] = b_d + s * beta[c]
            y_b[c] = s
            spk_b[c] = s
            u_b[c] = u
            vr_b[c] = after


@_jit
def lsnn_recurrent_back_step_jit(
    g_y: np.ndarray,
    g_mem: np.ndarray,
    given: tuple[bool, bool],
    carries: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    slope: np.ndarray,
    y: np.ndarray,
    params: np.ndarray,
    g_jump: np.ndarray,
) -> None:  # pragma: no cover - runs compiled
    """One step of `NorseLSNNKernel.backward`'s loop beside its product with the recurrent
    weight, its operations in their order: ``g_s = g_y + carry_z``, ``g_v = g_mem + carry_v``
    (in place, where given), ``g_u = slope * g_s``, ``g_vd = g_v * (1 - y) + g_u``, ``g_bd =
    carry_b - g_u``, ``carry_i`` into ``g_jump``, then ``carry_v = g_vd - g_vd * c_m``,
    ``carry_i = g_vd * c_m + (carry_i + carry_i * c_s)``, ``carry_b = g_bd - g_bd * c_a`` in
    place (every carry holds values: the torch loop starts from zeros).

    Args:
        g_y, g_mem, slope, y, g_jump: ``(n,)`` (``n = B * H``), the step's rows (``g_y``,
            ``g_mem``: unread where ``given`` says they are None).
        given: whether ``g_y`` and ``g_mem`` hold values.
        carries: ``(carry_z, carry_v, carry_i, carry_b)``, ``(n,)`` each: ``carry_z`` (the
            step's spike gradient from the next step's product) overwritten by ``g_s``.
        params: ``(3, H)``: ``c_m``, ``c_s``, ``c_a``.
    """
    one = y.dtype.type(1)
    carry_z, carry_v, carry_i, carry_b = carries
    n, h = y.shape[0], params.shape[1]
    if given[0]:
        for j in range(n):
            carry_z[j] = g_y[j] + carry_z[j]
    if given[1]:
        for j in range(n):
            carry_v[j] = g_mem[j] + carry_v[j]
    c_m, c_s, c_a = params[0], params[1], params[2]
    for start in range(0, n, h):
        stop = start + h
        g_s, g_v = carry_z[start:stop], carry_v[start:stop]
        g_i, g_b = carry_i[start:stop], carry_b[start:stop]
        slope_b, y_b, jump_b = slope[start:stop], y[start:stop], g_jump[start:stop]
        for c in range(h):
            g_u = slope_b[c] * g_s[c]
            g_vd = g_v[c] * (one - y_b[c]) + g_u
            g_bd = g_b[c] - g_u
            carried = g_i[c]
            jump_b[c] = carried
            g_v[c] = g_vd - g_vd * c_m[c]
            g_i[c] = g_vd * c_m[c] + (carried + carried * c_s[c])
            g_b[c] = g_bd - g_bd * c_a[c]
