"""`AffineChunk` for a block whose synapse is one plain ``nn.Linear`` (the engine's protocol:
`spikeckpt.engine.direct`): dense through ``F.linear`` on the chunk flattened to ``(k * B,
...)`` as the block's synapse runs it, or gathered over the input's non-zeros as its sparse
synapse runs it (`spikeckpt.adapters.gather`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from spikeckpt.adapters import jit_loops
from spikeckpt.adapters.gather import Transposed, finite, gather, gather_weight_grad
from spikeckpt.adapters.protocol import no_hooks
from spikeckpt.engine.amp import autocast_on
from spikeckpt.engine.inputs import SparseChunk, as_fresh, one_step_repeated
from spikeckpt.engine.phase import recomputing
from spikeckpt.storage.codecs import merged

__all__ = [
    "BREAK_EVEN",
    "LinearChunk",
    "SparseLimit",
    "sparse_positions",
    "sparse_share",
    "weight_positions",
]

#: ``(output features per torch thread, share of non-zero inputs)``: a ``Linear`` gathers
#: over its input's non-zeros up to this share (interpolated in log2 between the points, the
#: last share past the last point; none at or below the first point). The dense product's
#: speed grows with the threads, the listing of the non-zeros' does not, so the break-even
#: follows the outputs each thread computes; it also follows the CPU's dense speed. The
#: points sit at or below the break-evens measured on an AVX-512/AMX Xeon (one chunk's
#: passes, `benchmarks/bench_gather.py`: 128 outputs 0.03, 256 about 0.11, 512 and 1000
#: about 0.14; whole 784-H-10 training steps: 0.05-0.10 for 300-1000 outputs), where the
#: earlier points, measured on an AVX2 CPU (0.18-0.35 from 256 outputs), made training steps
#: 1.2-1.6x slower than the loop at 15-30% input spikes. On a CPU with a slower dense product
#: gathering would pay further up; a gather not taken runs the loop's own dense product.
BREAK_EVEN: tuple[tuple[int, float], ...] = (
    (64, 0.0),
    (128, 0.03),
    (256, 0.06),
    (512, 0.08),
    (1024, 0.10),
)


def sparse_share(out_features: int, threads: int) -> float:
    """The largest share of non-zero inputs at which a ``Linear`` with ``out_features``
    outputs gathers on ``threads`` CPU threads (`BREAK_EVEN`)."""
    per = out_features / max(1, threads)
    (x0, y0), *rest = BREAK_EVEN
    if per <= x0:
        return 0.0
    for x1, y1 in rest:
        if per <= x1:
            return y0 + (y1 - y0) * math.log2(per / x0) / math.log2(x1 / x0)
        x0, y0 = x1, y1
    return y0


class SparseLimit:
    """A block's gather limit: the threads are read in the forward pass and kept for its
    recomputation, so a recomputed chunk takes the path its forward pass took (a gather sums in
    another order than the dense product: another path could flip a spike)."""

    def __init__(self) -> None:
        self.threads: int | None = None
        self._finite: tuple[tuple[int, int, torch.Size], bool] | None = None

    def share(self, out_features: int) -> float:
        """`sparse_share` at the forward pass's thread count."""
        if self.threads is None or not recomputing():
            self.threads = torch.get_num_threads()
        return sparse_share(out_features, self.threads)

    def finite(self, weight: Tensor) -> bool:
        """`finite` of ``weight``, summed once per pass of the engine for a weight unchanged
        in it (the same storage, version and shape; `clear`, at the end of every pass, drops
        it: a weight changed through ``.data`` between passes is summed afresh). A sum per
        chunk took 260 us of a 2048 x 2048 weight, 1.4% of the peers' n = 2048 step."""
        key = (weight.data_ptr(), weight._version, weight.shape)
        if self._finite is None or self._finite[0] != key:
            self._finite = (key, finite(weight))
        return self._finite[1]

    def clear(self) -> None:
        self._finite = None


Positions = tuple[int, Tensor, Tensor, Tensor | None]


def sparse_positions(
    x: Tensor | SparseChunk, linear: nn.Linear, limit: SparseLimit
) -> Positions | None:
    """``(rows, row index, column index, values or None for ones)`` of the non-zeros of the
    chunk ``x (k, B, ..., in)`` flattened to ``(rows, in)``, where ``linear`` may gather over
    them (no hooks, and `weight_positions`), else None."""
    return weight_positions(x, linear.weight, limit) if no_hooks(linear) else None


def weight_positions(
    x: Tensor | SparseChunk, weight: Tensor, limit: SparseLimit
) -> Positions | None:
    """The non-zeros of ``x`` as `sparse_positions` gives them, where ``x @ weight.T`` may
    gather over them (CPU, the weight's dtype, no grad, no autocast, at most ``limit``'s share
    of ones, a finite weight), else None. Under ``torch.autocast`` the loop's product runs in
    the reduced dtype (a bf16 product, rounded to bf16): a float32 gather would give other
    values and dtype. A weight with a NaN or an infinity makes the loop's product NaN where
    the input is zero (``0 * nan``), which a gather over the non-zeros skips."""
    shape = x.shape
    if (
        x.device.type != "cpu"
        or autocast_on(x.device)
        or weight.device.type != "cpu"
        or x.dtype != weight.dtype
        or not x.dtype.is_floating_point
        or (isinstance(x, Tensor) and x.requires_grad)
        or len(shape) < 2
        or shape[-1] != weight.shape[1]
    ):
        return None
    share = limit.share(weight.shape[0])
    if share <= 0 or not limit.finite(weight):
        return None
    n_rows = shape[:-1].numel()
    if isinstance(x, SparseChunk):
        if x.ones > share * x.numel():
            return None
        rows = x.positions.div(shape[-1], rounding_mode="floor")
        return n_rows, rows, x.positions - rows * shape[-1], None
    strided = _positions_at_jit is not None and x.dtype in (torch.float32, torch.float64)
    strided = strided and x.dim() > 2 and x.numel() > 0
    if strided and not merged(x, 0, x.dim() - 1) and merged(x, 1, x.dim() - 1):
        # no (rows, in) view, a (k, rows, in) one: read where it lies
        return _listed_strided(x, share)
    flat = x.reshape(n_rows, shape[-1])
    # through a boolean view and NumPy: counted and listed at a third of torch.nonzero's cost
    # here (200 against 430 us for 25 x 16 x 512), the same positions in the same order
    nonzero = flat.bool().numpy()
    count = int(np.count_nonzero(nonzero))
    if count > share * flat.numel():
        return None
    if _positions_jit is not None and flat.dtype in (torch.float32, torch.float64):
        return n_rows, *_listed(flat.reshape(-1).numpy(), nonzero, count, shape[-1])
    found = np.flatnonzero(nonzero)
    if flat.numel() < 2**31:  # 32-bit positions: half the bytes (embedding_bag takes them)
        found = found.astype(np.int32)
    where = torch.from_numpy(found)
    values: Tensor | None
    values = flat.reshape(-1)[where]
    if bool((values == 1).all()):  # spikes: a weight of 1 is the weight itself, bitwise
        values = None
    rows = where.div(shape[-1], rounding_mode="floor")
    return n_rows, rows, where - rows * shape[-1], values


def _listed(
    values: np.ndarray, nonzero: np.ndarray, count: int, n_in: int, kernel: Any = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(rows, columns, values or None for ones)`` of the ``count`` non-zeros of the boolean
    array ``nonzero`` (row-major, ``in = n_in`` columns), in order, in one compiled pass
    (``kernel``: `_positions` reading ``values`` flat, the default, or `_positions_at`):
    32-bit positions where they fit, as `weight_positions`'s NumPy listing gives them,
    1.4-2.8x faster (a chunk of 21 x 32 x 700 at 5% ones: 0.25 against 0.71 ms on an AMD
    EPYC, allocations included). ``values``: float32 / float64."""
    index = np.int32 if nonzero.size < 2**31 else np.int64
    # the columns' array lists the positions first, one past the count (`_marked`)
    rows, cols = np.empty(count, index), np.empty(count + 1, index)
    kept = np.empty(count, values.dtype)
    mask = nonzero.reshape(-1).view(np.uint8)
    words = mask[: mask.size // 8 * 8].view(np.uint64)
    ones = (kernel or _positions_jit)(mask, words, values, n_in, rows, cols, kept)
    listed = torch.from_numpy(kept)
    return torch.from_numpy(rows), torch.from_numpy(cols[:count]), None if ones else listed


def _listed_strided(x: Tensor, share: float) -> Positions | None:
    """`weight_positions` of a chunk ``x (k, B, ..., in)`` that no ``(rows, in)`` view reads
    but a ``(k, rows, in)`` one does (a chunk of a permuted or batch-first input), read where
    it lies: the mask of non-zeros made by torch in row-major order, the values read at the
    positions alone (`_positions_at`); the same positions, values and index dtype as
    `_listed` of the chunk's copy, without that copy (the planner measured it as working
    memory: 1.7x shorter layer-wise chunks for a batch-first input). None above ``share``'s
    count of non-zeros."""
    nonzero = x.bool().numpy().reshape(-1)  # row-major (a copy where torch kept x's order)
    count = int(np.count_nonzero(nonzero))
    if count > share * x.numel():
        return None
    three = x.view(x.shape[0], -1, x.shape[-1]).numpy()
    return x.shape[:-1].numel(), *_listed(three, nonzero, count, x.shape[-1], _positions_at_jit)


def _marked(mask: np.ndarray, words: np.ndarray, found: np.ndarray) -> int:  # pragma: no cover
    """The positions ``i`` of the non-zeros of ``mask`` (0 / 1 bytes; ``words``: its first
    bytes as 64-bit words, eight skipped at once where all are zero) into ``found`` (one
    longer than their count), in order; returns their count. No branch per byte: each byte
    of a non-zero word is written and the count advanced by the byte (a branch per byte
    mispredicts at a few percent ones, 2.5x the time at 5% of 21 x 32 x 700 on an EPYC)."""
    j = 0
    for w in range(words.shape[0]):
        if words[w] != 0:
            for b in range(8):  # a constant count: unrolled (a range of w * 8.. took 1.45x)
                i = w * 8 + b
                found[j] = i  # kept where the byte is 1 (the count moves past it), else rewritten
                j += mask[i]
    for i in range(words.shape[0] * 8, mask.shape[0]):  # the last bytes, past the words
        found[j] = i
        j += mask[i]
    return j


_marked_jit = jit_loops._jit(_marked)


def _positions(
    mask: np.ndarray,
    words: np.ndarray,
    values: np.ndarray,
    n_in: int,
    rows: np.ndarray,
    cols: np.ndarray,
    kept: np.ndarray,
) -> bool:  # pragma: no cover - runs compiled
    """The ``n`` non-zeros of ``mask`` (as `_marked` takes it): each one's row ``i // n_in``,
    column and value ``values[i]`` into ``rows``, ``cols`` and ``kept`` (``n``, ``n + 1``,
    ``n``), in order. Returns whether every value is 1. The positions are listed into
    ``cols`` first (`_marked`), then split into row and column in place."""
    ones = True
    for k in range(_marked_jit(mask, words, cols)):
        i = cols[k]
        r = i // n_in
        rows[k] = r
        cols[k] = i - r * n_in
        v = values[i]
        kept[k] = v
        ones &= v == 1
    return ones


def _positions_at(
    mask: np.ndarray,
    words: np.ndarray,
    values: np.ndarray,
    n_in: int,
    rows: np.ndarray,
    cols: np.ndarray,
    kept: np.ndarray,
) -> bool:  # pragma: no cover - runs compiled
    """`_positions` reading each non-zero's value from ``values`` ``(k, B, n_in)`` (any
    strides) at its step, row and column."""
    per_step = values.shape[1]
    ones = True
    t = 0  # the step of row r, and its first row: rows ascend, no division per non-zero
    first = 0
    for k in range(_marked_jit(mask, words, cols)):
        i = cols[k]
        r = i // n_in
        rows[k] = r
        cols[k] = i - r * n_in
        while r - first >= per_step:
            t += 1
            first += per_step
        v = values[t, r - first, cols[k]]
        kept[k] = v
        ones &= v == 1
    return ones


_positions_jit = jit_loops._jit(_positions)
_positions_at_jit = jit_loops._jit(_positions_at)


class LinearChunk:
    """One plain ``nn.Linear`` as an `AffineChunk`.

    Args:
        linear: the module (its own ``forward``, no hooks when it runs).
        transposed: the block's kept transpose of a small weight (shared with its sparse
            synapse, so both gather from the same values).
        limit: the block's gather limit (shared with its sparse synapse: both take the same
            path for a chunk).
        per_step: the forward product step by step, ``B`` rows each, as the plain loop and
            the block's ``synapse`` (``exact``) compute it; else one product over the chunk.
        fresh: with ``per_step``, each step read from where a new tensor's data starts
            (`as_fresh`), as the block's ``synapse`` reads it (a block after the first).
    """

    def __init__(
        self,
        linear: nn.Linear,
        transposed: Transposed,
        limit: SparseLimit,
        per_step: bool = False,
        fresh: bool = False,
    ) -> None:
        self.linear = linear
        self.transposed = transposed
        self.limit = limit
        self.per_step = per_step
        self.fresh = fresh

    @property
    def params(self) -> tuple[Tensor, ...]:
        bias = self.linear.bias
        return (self.linear.weight,) if bias is None else (self.linear.weight, bias)

    def forward(
        self, x: Tensor | SparseChunk, sparse: bool, lead: int = 0
    ) -> tuple[Tensor, Any] | None:
        linear = self.linear
        weight, bias = linear.weight, linear.bias
        if not no_hooks(linear) or autocast_on(x.device):
            return None
        k, b = x.shape[0], x.shape[1]
        if not self.per_step and one_step_repeated(x):  # as the block's synapse: once
            x0 = x[0]
            if x0.dtype != weight.dtype or x0.device != weight.device:
                return None
            room = x0.new_empty(k + lead, *x0.shape[:-1], weight.shape[0])
            room[lead:] = nn.functional.linear(x[:1].reshape(x0.shape), weight, bias)
            return room, (None, x0)
        found = sparse_positions(x, linear, self.limit) if sparse else None
        if found is not None:
            n_rows, rows, cols, values = found
            t_weight = self.transposed.of(weight)
            z = gather(weight, n_rows, rows, cols, values, t_weight, lead * n_rows // k)
            if bias is not None:
                z.add_(bias)  # the lead rows too: never read
            return z.reshape(k + lead, *x.shape[1:-1], z.shape[-1]), (found, None)
        dense = x.dense() if isinstance(x, SparseChunk) else x
        if dense.dtype != weight.dtype or dense.device != weight.device:
            return None
        flat = dense.reshape(k * b, *dense.shape[2:])
        if self.per_step:  # the loop's own products (F.linear of each step), into the room
            room = flat.new_empty(k + lead, b, *dense.shape[2:-1], weight.shape[0])
            for t, x_t in enumerate(dense.unbind(0)):
                step = as_fresh(x_t) if self.fresh else x_t
                room[lead + t] = nn.functional.linear(step, weight, bias)
            return room, (None, flat)
        if not lead or flat.dim() != 2:
            z = nn.functional.linear(flat, weight, bias)
            if lead:  # not a matrix product into a buffer: one copy into the lead's room
                room = z.new_empty((k + lead) * b, *z.shape[1:])
                room[lead * b :] = z
                z = room
            return z.reshape(k + lead, b, *z.shape[1:]), (None, flat)
        # F.linear of a matrix is addmm (mm without a bias): the same product, into the room
        room = flat.new_empty((k + lead) * b, weight.shape[0])
        if bias is None:
            torch.mm(flat, weight.t(), out=room[lead * b :])
        else:
            torch.addmm(bias, flat, weight.t(), out=room[lead * b :])
        return room.reshape(k + lead, b, weight.shape[0]), (None, flat)

    def backward(
        self,
        saved: Any,
        g_z: Tensor,
        want_input: bool,
        sums: Sequence[Tensor | None],
        need: Sequence[bool],
    ) -> tuple[Tensor | None, list[Tensor | None]]:
        found, flat = saved
        weight = self.linear.weight
        out, n_in = weight.shape
        g = g_z.reshape(-1, out)
        new: list[Tensor | None] = [None] * len(sums)
        if need[0]:
            if found is not None:
                _, rows, cols, values = found
                new[0] = gather_weight_grad(g, rows, cols, values, (out, n_in), sums[0])
            else:
                x2 = flat.reshape(-1, n_in)
                g_w = g
                if x2.shape[0] < g.shape[0]:  # a static input: one step's rows, every step
                    g_w = g.reshape(-1, x2.shape[0], out).sum(0)
                new[0] = g_w.t().mm(x2) if sums[0] is None else sums[0].addmm_(g_w.t(), x2)
        if len(sums) > 1 and need[1]:
            g_b = g.sum(0)
            new[1] = g_b if sums[1] is None else sums[1].add_(g_b)
        g_in = None
        if want_input:  # dL/dz @ W, whichever way z was made
            g_in = g.mm(weight).reshape(*g_z.shape[:-1], n_in)
        return g_in, new
