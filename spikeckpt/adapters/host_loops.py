"""The membrane recurrence of a fused chunk on the CPU, compiled (Numba) or through NumPy.

A chunk's recurrence (``mem_t = decay * mem + z_t - r_t * thr``, then the spike ``mem_t > thr``)
is a few elementwise operations per step. On a CPU step of a few thousand neurons each torch
call costs more in dispatch (2-4 us) than in arithmetic; NumPy's ufuncs on views of the same
buffers cost a third of that. The operations are the same IEEE float32/float64 operations in
the same order (one rounding each), so the results are bitwise the torch loop's; the torch loop
runs wherever these functions decline (CUDA, other dtypes, mixed dtypes, large steps, subnormals
flushed).

Where Numba is installed the recurrence runs compiled instead (`spikeckpt.adapters.jit_loops`:
one call per chunk, the same operations), for steps of any size: 16 x 512 neurons, chunk of 25
steps, 42 us per chunk against NumPy's 325 us; 16 x 2048 137 us against torch's ~1.7 ms per
chunk of 8 steps. `USE_JIT` switches it off (tests compare the three loops).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from spikeckpt.adapters import jit_loops
from spikeckpt.engine.compiled import is_compiling

__all__ = [
    "HOST_LOOP_ELEMENTS",
    "USE_JIT",
    "leaky_backward_on_host",
    "leaky_forward_on_host",
    "synaptic_backward_on_host",
    "synaptic_forward_on_host",
]

#: a step of at most this many elements runs through NumPy (measured on one CPU thread:
#: 16 x 256 float32, chunk 8: 52 us per chunk against torch's 135 us; 16 x 512: 494 vs 545 us;
#: 16 x 2048: 1896 vs 1667 us, where the arithmetic dominates and torch's kernels win)
HOST_LOOP_ELEMENTS = 1 << 13

#: run the compiled loops where Numba is installed (any step size; else NumPy's, small steps)
USE_JIT = jit_loops.leaky_forward_jit is not None


def _host_arrays(*tensors: Tensor) -> list[np.ndarray] | None:
    """NumPy views of CPU tensors of one float dtype whose steps are small, or None (also
    while ``torch.compile`` traces: the torch loop then compiles whole, with no graph break
    into NumPy or Numba)."""
    if is_compiling():
        return None
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in (torch.float32, torch.float64):
        return None
    if any(t.device != first.device or t.dtype != first.dtype for t in tensors):
        return None
    return [t.detach().numpy() for t in tensors]


def leaky_forward_on_host(
    mem: Tensor,
    zin: Tensor,
    decay: Tensor,
    thr: Tensor,
    reset: str,
    mems: Tensor | None,
    fires: Tensor,
) -> Tensor | None:
    """Run the chunk's steps into ``mems[1:]`` and ``fires[1:]`` (``fires[0]`` given): the
    membrane ``decay * mem + z_t`` and its ``reset`` (a `jit_loops.RESET_CODES` name; where
    the last step fired: ``"subtract"`` less ``thr``, ``"zero_after"`` zero, ``"zero_before"``
    from zero), and its spike ``mem_t > thr``. Returns the last membrane, or None (nothing
    written, nothing allocated) where neither the compiled loop nor NumPy's runs it (NumPy's
    only subtracts or does not reset).

    Args:
        mem: the membrane before the chunk, ``(B, ...)``.
        zin: the chunk's input, ``(k, B, ...)``.
        decay, thr: broadcastable against ``mem``.
        mems: ``(k + 1, B, ...)`` membrane buffer (row 0 is not read; rows 1.. may be
            ``zin`` itself, each read before it is written), or None where the membranes are
            not kept (one row made here holds each step's in turn).
        fires: ``(k + 1, B, ...)`` bool spikes; row 0 holds the reset of step 0.
    """
    k = zin.shape[0]
    if not k or not fires.is_contiguous() or _host_arrays(mem, zin, decay, thr) is None:
        return None
    steps_fit = _steps_fit(mem, decay, thr)
    kept_fits = mems is None or (mems.is_contiguous() and mems.dtype == mem.dtype)
    if USE_JIT and steps_fit and kept_fits:
        return _leaky_forward_compiled(mem, zin, decay, thr, reset, mems, fires)
    if mem.numel() > HOST_LOOP_ELEMENTS or reset not in ("subtract", "none"):
        return None
    subtract = reset == "subtract"
    # without ``mems`` one row, written in place step after step (each step's decay goes to
    # its own buffer first): the last membrane owns exactly its own storage
    buffer = mems if mems is not None else mem.new_empty((1, *mem.shape))
    arrays = _host_arrays(mem, zin, decay, thr, buffer)
    if arrays is None:  # a kept buffer of another dtype or layout
        return None
    m, z, d, th, out = arrays
    fired = fires.numpy()
    rows = out.shape[0]
    decayed = np.empty(np.broadcast_shapes(d.shape, m.shape), dtype=out.dtype)
    for t in range(z.shape[0]):
        row = out[(t + 1) % rows]
        # the input is read before the row is written: ``mems`` may hold ``zin`` in rows 1..
        np.multiply(d, m, out=decayed)
        np.add(decayed, z[t], out=row)
        if subtract:
            np.subtract(row, th, out=row, where=fired[t])
        np.greater(row, th, out=fired[t + 1])
        m = row
    return buffer[k % rows]


def leaky_backward_on_host(
    g: Tensor, decay: Tensor, carry: Tensor | None, reset: str, fired: Tensor
) -> Tensor | None:
    """``g[t] += carry; carry = decay * g[t]`` from the last step to the first, in place on
    ``g`` ``(k, B, ...)`` (the zero resets: ``g[t]`` times ``1 - r_t`` before the decay after
    the input, the carry times it before the input; ``r_t`` is ``fired[t]``, ``fired``
    ``(k + 1, B, ...)`` bool); returns the carry into the state before the chunk, or None where
    it does not run here (``g`` untouched)."""
    if not g.shape[0]:
        return None
    arrays = _host_arrays(g, decay, *(() if carry is None else (carry,)))
    if arrays is None:
        return None
    if USE_JIT and g.is_contiguous() and fired.is_contiguous():
        compiled = _leaky_backward_compiled(g, decay, carry, reset, fired)
        if compiled is not None:
            return compiled
    if g[0].numel() > HOST_LOOP_ELEMENTS or reset not in ("subtract", "none"):
        return None
    gn, d = arrays[0], arrays[1]
    shape = np.broadcast_shapes(d.shape, gn.shape[1:])
    if carry is not None:
        shape = np.broadcast_shapes(shape, carry.shape)
    out = np.empty(shape, dtype=gn.dtype)
    c = arrays[2] if carry is not None else None
    for t in range(gn.shape[0] - 1, -1, -1):
        if c is not None:
            np.add(gn[t], c, out=gn[t])
        np.multiply(d, gn[t], out=out)
        c = out
    return torch.from_numpy(out)


def _flat(tensor: Tensor, shape: torch.Size) -> np.ndarray:
    """``tensor`` broadcast to ``shape`` as a contiguous, writable 1-D array (a copy where
    needed; never a read-only broadcast view, which Numba would compile for separately)."""
    array = tensor.detach().numpy()
    if array.shape != shape or not (array.flags.writeable and array.flags.c_contiguous):
        array = np.array(np.broadcast_to(array, shape), order="C")
    return array.reshape(-1)


def _leaky_forward_compiled(
    mem: Tensor,
    zin: Tensor,
    decay: Tensor,
    thr: Tensor,
    reset: str,
    mems: Tensor | None,
    fires: Tensor,
) -> Tensor:
    """`leaky_forward_on_host` through the compiled loop (``mems`` None or contiguous; decay
    and threshold no wider than a step)."""
    k, shape = zin.shape[0], mem.shape
    buffer = mems if mems is not None else mem.new_empty((1, *shape))
    rows = buffer.shape[0]
    jit_loops.leaky_forward_jit(
        _flat(mem, shape),
        zin.detach().numpy().reshape(k, -1),  # a copy only if not contiguous: it is only read
        _flat(decay, shape),
        _flat(thr, shape),
        jit_loops.RESET_CODES[reset],
        buffer.detach().numpy().reshape(rows, -1),
        fires.numpy().reshape(k + 1, -1),
    )
    return buffer[k % rows]


def _leaky_backward_compiled(
    g: Tensor, decay: Tensor, carry: Tensor | None, reset: str, fired: Tensor
) -> Tensor | None:
    """`leaky_backward_on_host` through the compiled loop (``g`` contiguous), or None where a
    carry or decay is wider than one step."""
    # NumPy's broadcast_shapes: torch's runs its symbolic-shape checks (14 against 1.3 us,
    # per chunk of every block)
    shape: tuple[int, ...] = g.shape[1:]
    if carry is not None:
        shape = np.broadcast_shapes(shape, carry.shape)
    shape = np.broadcast_shapes(shape, decay.shape)
    if shape != g.shape[1:]:  # a carry or decay wider than a step: NumPy's loop broadcasts
        return None
    out = np.empty(shape, dtype=g.detach().numpy().dtype)
    jit_loops.leaky_backward_jit(
        g.detach().numpy().reshape(g.shape[0], -1),
        _flat(decay, shape),
        _flat(carry, shape) if carry is not None else out.reshape(-1),
        carry is not None,
        out.reshape(-1),
        fired.numpy().reshape(fired.shape[0], -1),
        jit_loops.RESET_CODES[reset],
    )
    return torch.from_numpy(out)


def _steps_fit(state: Tensor, *others: Tensor) -> bool:
    """Whether ``others`` broadcast to exactly ``state``'s shape (no wider than a step)."""
    return np.broadcast_shapes(state.shape, *(t.shape for t in others)) == state.shape


def synaptic_forward_on_host(
    syn: Tensor,
    mem: Tensor,
    zin: Tensor,
    alpha: Tensor,
    beta: Tensor,
    thr: Tensor,
    reset: str,
    hold: bool,
    fires: Tensor,
) -> tuple[Tensor, Tensor] | None:
    """snnTorch ``Synaptic``'s chunk through the compiled loop: spikes into ``fires[1:]``
    (``(k + 1, B, ...)`` bool, row 0 given), and the currents and membranes returned, each
    ``(k + 1, B, ...)`` with the states before the chunk in row 0 where ``hold``, else
    ``(1, B, ...)`` holding the last step's; or None (nothing written) where it does not run
    (no Numba, not a CPU float dtype, mixed dtypes, parameters wider than a step)."""
    k = zin.shape[0]
    if not (USE_JIT and k and fires.is_contiguous() and syn.shape == mem.shape):
        return None
    if _host_arrays(syn, mem, zin, alpha, beta, thr) is None or not _steps_fit(
        mem, alpha, beta, thr
    ):
        return None
    shape = mem.shape
    rows = k + 1 if hold else 1
    syns, mems = mem.new_empty((rows, *shape)), mem.new_empty((rows, *shape))
    if hold:
        syns[0], mems[0] = syn, mem
    jit_loops.synaptic_forward_jit(
        _flat(syn, shape),
        _flat(mem, shape),
        zin.detach().numpy().reshape(k, -1),
        _flat(alpha, shape),
        _flat(beta, shape),
        _flat(thr, shape),
        jit_loops.RESET_CODES[reset],
        syns.numpy().reshape(rows, -1),
        mems.numpy().reshape(rows, -1),
        fires.numpy().reshape(k + 1, -1),
    )
    return syns, mems


def synaptic_backward_on_host(
    g_mem: Tensor,
    alpha: Tensor,
    beta: Tensor,
    fired: Tensor,
    reset: str,
    carries: tuple[Tensor | None, Tensor | None],
    g_syns: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """The Synaptic chunk's backward through the compiled loop: ``g_mem`` ``(k, B, ...)``
    becomes dL/d mem_t in place; returns dL/d syn_t ``(k, B, ...)`` and the carries into the
    current and the membrane before the chunk, or None (``g_mem`` untouched) where it does not
    run. ``carries``: dL/d the membrane and the current after the chunk (or None);
    ``g_syns``: dL/d each step's current given from outside (the call's emitted ``syn``)."""
    k = g_mem.shape[0]
    carry_mem, carry_syn = carries
    carries_in = [c for c in carries if c is not None]
    extra = [] if g_syns is None else [g_syns]
    if not (USE_JIT and k and g_mem.is_contiguous() and fired.is_contiguous()):
        return None
    if _host_arrays(g_mem, alpha, beta, *carries_in, *extra) is None:
        return None
    if not _steps_fit(g_mem[0], alpha, beta, *carries_in):
        return None
    shape = g_mem.shape[1:]
    g_syn = torch.empty_like(g_mem)
    # fresh carries: the loop writes them (a gradient handed in is never written over)
    out_mem, out_syn = g_mem.new_zeros(shape), g_mem.new_zeros(shape)
    if carry_mem is not None:
        out_mem.copy_(carry_mem)
    if carry_syn is not None:
        out_syn.copy_(carry_syn)
    given = g_syn if g_syns is None else g_syns.detach().contiguous()  # unread without g_syns
    jit_loops.synaptic_backward_jit(
        g_mem.detach().numpy().reshape(k, -1),
        g_syn.numpy().reshape(k, -1),
        _flat(alpha, shape),
        _flat(beta, shape),
        fired.numpy().reshape(fired.shape[0], -1),
        jit_loops.RESET_CODES[reset],
        (out_mem.numpy().reshape(-1), out_syn.numpy().reshape(-1)),
        (carry_mem is not None, carry_syn is not None, g_syns is not None),
        given.numpy().reshape(k, -1),
    )
    return g_syn, out_syn, out_mem


#: `_stacked`'s arrays of rows that are numbers (Python's, 0-d tensors), by shape, dtype and
#: values: Norse's scalar parameters made the same array at every chunk's forward,
#: recomputation and backward (a LIFCell at T = 25 ran 1.29x its loop's time, 1.11x so kept)
_STACKED: dict[tuple[Any, ...], np.ndarray] = {}
_STACKED_KEPT = 8


def _stacked(shape: torch.Size, like: Tensor, *rows: Tensor | float | None) -> np.ndarray | None:
    """``rows`` broadcast to ``shape`` and stacked as ``(len(rows), numel)`` (None rows: zeros;
    a Python number: rounded to ``like``'s dtype once, as torch rounds a scalar operand), or
    None where one is wider than a step or of another dtype or device than ``like``. Rows of
    numbers only give a kept array (the compiled loops only read it)."""
    key = _numbers_key(shape, like, rows)
    found = _STACKED.get(key) if key is not None else None
    if found is not None:
        return found
    out = _stacked_anew(shape, like, rows)
    if key is not None and out is not None:
        if len(_STACKED) >= _STACKED_KEPT:
            _STACKED.pop(next(iter(_STACKED)))
        _STACKED[key] = out
    return out


def _numbers_key(
    shape: torch.Size, like: Tensor, rows: tuple[Tensor | float | None, ...]
) -> tuple[Any, ...] | None:
    """``(shape, dtype, values)`` where every row is None, a Python number or a 0-d tensor of
    ``like``'s dtype and device (read once here), else None."""
    values: list[Any] = []
    for row in rows:
        if row is None or isinstance(row, (int, float)):
            values.append(row)
        elif row.dim() == 0 and row.dtype == like.dtype and row.device == like.device:
            values.append(("t", row.item()))
        else:
            return None
    return (tuple(shape), like.dtype, tuple(values))


def _stacked_anew(
    shape: torch.Size, like: Tensor, rows: tuple[Tensor | float | None, ...]
) -> np.ndarray | None:
    """`_stacked`, made."""
    out = np.zeros((len(rows), int(np.prod(shape))), dtype=like.detach().numpy().dtype)
    for r, tensor in enumerate(rows):
        if tensor is None:
            continue
        if isinstance(tensor, (int, float)):
            out[r] = tensor
            continue
        if tensor.device != like.device or tensor.dtype != like.dtype:
            return None
        if not _steps_fit(like, tensor):
            return None
        out[r] = np.broadcast_to(tensor.detach().numpy(), shape).reshape(-1)
    return out


def norse_forward_on_host(
    v: Tensor,
    i: Tensor | None,
    z: Tensor,
    params: tuple[Tensor | float | None, ...],
    mode: str,
    subtract: bool,
    hold: bool,
    pre: Tensor | None = None,
    want_y: bool = True,
) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
    """Norse's feed-forward step over a chunk through the compiled loop (`NorseKernel`'s
    operations): ``params`` = ``(dt * tau_mem_inv, v_leak, v_th, v_reset, -dt * tau_syn_inv)``
    (None where the mode has none). Returns the membranes and currents (``(k + 1, B, ...)``
    with the states before the chunk in row 0 where ``hold``, else ``(1, B, ...)``: the last
    step's; currents None for ``"box"``) and the outputs ``(k, B, ...)`` (None without
    ``want_y``), or None where it does not run. ``pre`` ``(k, B, ...)``, contiguous in ``v``'s
    dtype (it may be ``z``, then overwritten): each step's membrane before its reset."""
    k = z.shape[0]
    if not (USE_JIT and k) or (i is not None and i.shape != v.shape):
        return None
    if _host_arrays(v, z, *(t for t in (i, pre) if t is not None)) is None:
        return None
    if pre is not None and (pre.shape != z.shape or not pre.is_contiguous()):
        return None
    shape = v.shape
    stacked = _stacked(shape, v, *params)
    if stacked is None:
        return None
    rows = k + 1 if hold else 1
    vs = v.new_empty((rows, *shape))
    is_ = v.new_empty((rows, *shape)) if i is not None else vs  # "box": never written
    y = v.new_empty((k if want_y or pre is None else 1, *shape))  # one row: pre's loop only
    if hold:
        vs[0] = v
        if i is not None:
            is_[0] = i
    arrays = (
        _flat(v, shape),
        _flat(i, shape) if i is not None else _flat(v, shape),
        z.detach().numpy().reshape(k, -1),
        stacked,
        jit_loops.NORSE_MODES[mode],
        subtract,
        vs.detach().numpy().reshape(rows, -1),
        is_.detach().numpy().reshape(rows, -1),
        y.numpy().reshape(y.shape[0], -1),
    )
    if pre is None:
        jit_loops.norse_forward_jit(*arrays)
    else:
        jit_loops.norse_forward_pre_jit(*arrays, pre.detach().numpy().reshape(k, -1))
    return vs, (is_ if i is not None else None), y if want_y else None


def _carry_buffers(
    like: Tensor, carries: tuple[Tensor | None, Tensor | None]
) -> tuple[Tensor, Tensor]:
    """The compiled Norse backwards' carry buffers ``(v, i)``, each shaped as a step of
    ``like`` ``(k, B, ...)``: fresh, zeros or the given final state's gradient (a gradient
    handed in is never written over)."""
    shape = like.shape[1:]
    buffers = like.new_zeros(shape), like.new_zeros(shape)
    for out, carry in zip(buffers, carries, strict=True):
        if carry is not None:
            out.copy_(carry.expand(shape))
    return buffers


def norse_backward_on_host(
    v_d: Tensor,
    y: Tensor,
    deriv: Tensor | None,
    g_y: Tensor | None,
    g_mem: Tensor | None,
    params: tuple[Tensor | float | None, ...],
    mode: str,
    subtract: bool,
    carries: tuple[Tensor | None, Tensor | None],
    wanted: tuple[bool, bool, bool] = (True, True, True),
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor] | None:
    """`NorseKernel.backward`'s loop through the compiled one: ``params`` = ``(v_th,
    v_reset, 1 - c_m, c_m, 1 + c_s)``, ``carries`` = the final states' gradients. Returns
    ``g_vd``, ``g_u`` (None for ``"li"``), ``g_in`` (None for ``"box"``), ``g_vn_all`` (each
    ``(k, B, ...)``) and the carries into ``v`` and ``i``, or None where it does not run.
    ``wanted``: whether ``g_vd``, ``g_u`` and ``g_vn_all`` are read afterwards; those that
    are not share one scratch buffer (the loop only writes them) and come back None
    (``g_vd`` is always kept for ``"box"``, where it is ``g_in``)."""
    k = v_d.shape[0]
    given = [t for t in (deriv, g_y, g_mem, *carries) if t is not None]
    if not (USE_JIT and k) or _host_arrays(v_d, y, *given) is None:
        return None
    if any(t.shape != v_d.shape for t in (y, deriv, g_y, g_mem) if t is not None):
        return None
    shape = v_d.shape[1:]
    if any(not _steps_fit(v_d[0], c) for c in carries if c is not None):
        return None
    stacked = _stacked(shape, v_d, *params)
    if stacked is None:
        return None
    flat = [
        (t if t is not None else v_d).detach().contiguous().numpy().reshape(k, -1)
        for t in (v_d, y, deriv, g_y, g_mem)
    ]
    keep_vd, keep_u, keep_vn = wanted[0] or mode == "box", wanted[1], wanted[2]
    scratch = None if keep_vd and keep_u and keep_vn else torch.empty_like(v_d)
    g_vd = torch.empty_like(v_d) if keep_vd else scratch
    g_vn_all = torch.empty_like(v_d) if keep_vn else scratch
    # the loop writes g_u except for "li" and g_in except for "box": there it gets g_vd
    g_u = g_vd if mode == "li" else (torch.empty_like(v_d) if keep_u else scratch)
    g_in = g_vd if mode == "box" else torch.empty_like(v_d)
    assert g_vd is not None and g_u is not None and g_vn_all is not None and g_in is not None
    out_v, out_i = _carry_buffers(v_d, carries)
    jit_loops.norse_backward_jit(
        flat[0],
        flat[1],
        flat[2],
        deriv is not None,
        flat[3],
        g_y is not None,
        flat[4],
        g_mem is not None,
        stacked,
        jit_loops.NORSE_MODES[mode],
        subtract,
        out_v.numpy().reshape(-1),
        carries[0] is not None,
        out_i.numpy().reshape(-1),
        carries[1] is not None,
        *(t.numpy().reshape(k, -1) for t in (g_vd, g_u, g_in, g_vn_all)),
    )
    return (
        g_vd if keep_vd else None,
        None if mode == "li" or not keep_u else g_u,
        None if mode == "box" else g_in,
        g_vn_all if keep_vn else None,
        out_v,
        out_i,
    )


def norse_backward_lean_on_host(
    pre: Tensor,
    g_z: Tensor,
    g_y: Tensor | None,
    g_mem: Tensor | None,
    params: tuple[Tensor | float | None, ...],
    slope: str,
    mode: str,
    subtract: bool,
    carries: tuple[Tensor | None, Tensor | None],
) -> tuple[Tensor, Tensor, Tensor]:
    """`NorseKernel`'s backward where no parameter field needs a gradient, from the membranes
    before each reset ``pre`` ``(k, B, ...)`` alone (unread for ``"li"``, which reads
    none): ``(dL/dz, dL/dv, dL/di)`` at the chunk's start
    (`jit_loops.norse_backward_lean_jit`); ``dL/dz`` goes to ``g_z``, which may be ``pre``
    (both contiguous). ``params`` as `norse_backward_on_host`'s; ``slope`` a
    `jit_loops.NORSE_SLOPES` name. The caller ran the chunk through `norse_forward_on_host`
    with these fields, so the compiled loop is there."""
    k, shape = g_z.shape[0], g_z.shape[1:]
    stacked = _stacked(shape, g_z, *params)
    assert stacked is not None, "the forward's check passed with these fields"
    assert pre.is_contiguous() and g_z.is_contiguous(), "the kept membranes: one buffer"

    def rows(t: Tensor | None) -> np.ndarray:
        given = g_z if t is None else t.detach().to(g_z.dtype).contiguous()
        return given.numpy().reshape(k, -1)

    out_v, out_i = _carry_buffers(g_z, carries)
    jit_loops.norse_backward_lean_jit(
        rows(pre),
        rows(g_y),
        g_y is not None,
        rows(g_mem),
        g_mem is not None,
        stacked,
        jit_loops.NORSE_SLOPES[slope],
        jit_loops.NORSE_MODES[mode],
        subtract,
        out_v.numpy().reshape(-1),
        carries[0] is not None,
        out_i.numpy().reshape(-1),
        carries[1] is not None,
        rows(None),
    )
    return g_z, out_v, out_i
