"""Binomial checkpointing arithmetic (Griewank & Walther). Pure Python, cached.

``beta(s, r) = C(s + r, s)`` is the most steps ``s`` checkpoint slots can reverse when no step
is advanced more than ``r`` times. For ``l`` steps and ``s`` slots, ``reps(l, s)`` is the least
``r`` with ``beta(s, r) >= l`` and ``advances(l, s) = r*l - beta(s + 1, r - 1)`` is the least
number of untaped step evaluations (the first forward sweep included) needed to reverse the
``l`` steps when each step is also taped once.
"""

from __future__ import annotations

from functools import lru_cache
from math import comb


def beta(slots: int, reps: int) -> int:
    """``C(slots + reps, slots)``; 0 for negative ``reps``."""
    if reps < 0:
        return 0
    return comb(slots + reps, slots)


@lru_cache(maxsize=1 << 18)
def reps(steps: int, slots: int) -> int:
    """Least ``r`` with ``beta(slots, r) >= steps`` (``steps >= 1``, ``slots >= 1``)."""
    r, value = 0, 1
    while value < steps:
        value = value * (slots + r + 1) // (r + 1)
        r += 1
    return r


@lru_cache(maxsize=1 << 18)
def advances(steps: int, slots: int) -> int:
    """``t(l, s)``: least untaped evaluations to reverse ``steps`` steps with ``slots`` slots.

    Oracles: ``advances(10, 2) == 20``, ``advances(1000, 50) == 1948``.
    """
    r = reps(steps, slots)
    return r * steps - beta(slots + 1, r - 1)


def split(steps: int, slots: int) -> int:
    """An optimal length of the first advance when reversing ``steps`` steps with ``slots`` slots.

    Minimises ``m + advances(steps - m, slots - 1) + advances(m, slots)`` over ``1 <= m < steps``.
    The objective is convex in ``m`` (its increments are non-decreasing), so a binary search on
    the increments finds the least optimal ``m``. Needs ``steps >= 2`` and ``slots >= 2``.
    """

    def total(m: int) -> int:
        return m + advances(steps - m, slots - 1) + advances(m, slots)

    lo, hi = 1, steps - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if total(mid + 1) >= total(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
