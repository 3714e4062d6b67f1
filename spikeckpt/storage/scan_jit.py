"""The codecs' scan of a CPU tensor's bits in one compiled pass (Numba), where NumPy takes
three (`spikeckpt.storage.codecs._scan_numpy`: the mask of ones, its count, the count of
non-zero bit patterns): each element read once, the same counts and mask. None without Numba
(the NumPy passes run)."""

from __future__ import annotations

import numpy as np

from spikeckpt.numba_jit import jit

__all__ = ["bits_counted", "bits_counted_rows", "ones_masked"]


def _ones_masked(
    raw: np.ndarray, one: int, mask: np.ndarray
) -> tuple[int, int]:  # pragma: no cover
    """``mask[i] = raw[i] == one`` over the ``(n,)`` bit patterns ``raw``; returns ``(the
    count of ones, the count of non-zero patterns)``: equal where ``raw`` is exactly binary."""
    ones = 0
    nonzero = 0
    for i in range(raw.shape[0]):
        bits = raw[i]
        is_one = bits == one
        mask[i] = is_one
        ones += is_one
        nonzero += bits != 0
    return ones, nonzero


def _bits_counted(raw: np.ndarray, one: int) -> tuple[int, int]:  # pragma: no cover
    """`_ones_masked`'s counts without the mask."""
    ones = 0
    nonzero = 0
    for i in range(raw.shape[0]):
        bits = raw[i]
        ones += bits == one
        nonzero += bits != 0
    return ones, nonzero


def _bits_counted_rows(
    raw: np.ndarray, starts: np.ndarray, n: int, one: int
) -> tuple[int, int]:  # pragma: no cover
    """`_bits_counted` over the rows ``raw[start : start + n]`` for each of ``starts`` (a
    tensor whose rows are contiguous and no flat view reads: a chunk of a permuted input,
    read where it lies, not copied)."""
    ones = 0
    nonzero = 0
    for start in starts:
        row = raw[start : start + n]  # indices from 0: no wraparound test, vectorized
        for i in range(n):
            bits = row[i]
            ones += bits == one
            nonzero += bits != 0
    return ones, nonzero


ones_masked = jit(_ones_masked)
bits_counted = jit(_bits_counted)
bits_counted_rows = jit(_bits_counted_rows)
