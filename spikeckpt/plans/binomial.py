"""Binomial checkpointing arithmetic (Griewank & Walther). Pure Python, cached.

``beta(s, r) = C(s + r, s)`` is the most steps ``s`` checkpoint slots can reverse when no step
is advanced more than ``r`` times. For ``l`` steps and ``s`` slots, ``reps(l, s)`` is the least
``r`` with ``beta(s, r) >= l`` and ``advances(l, s) = r*l - beta(s + 1, r - 1)`` is the least
number of untaped step evaluations (the first forward sweep included) needed to reverse the
``l`` steps when each step is also taped once.
"""

from __future__ import annotations

from functools import lru_cache
from math import comb, isqrt

from spikeckpt.errors import ConfigError


def _check(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int >= {least}, got {value!r}")
    if value < least:
        raise ConfigError(f"{name} must be >= {least}, got {value}")
    return value


def beta(slots: int, reps: int) -> int:
    """``C(slots + reps, slots)``; 0 for negative ``reps`` (``slots >= 0``)."""
    _check("slots", slots, 0)
    if reps < 0:
        return 0
    return comb(slots + reps, slots)


def reps(steps: int, slots: int) -> int:
    """Least ``r`` with ``beta(slots, r) >= steps`` (``steps >= 1``, ``slots >= 1``).

    Raises ValueError for fewer than one step or slot (no number of repetitions reverses a
    step without a checkpoint slot).
    """
    return _reps(_check("steps", steps, 1), _check("slots", slots, 1))


def advances(steps: int, slots: int) -> int:
    """``t(l, s)``: least untaped evaluations to reverse ``steps`` steps with ``slots`` slots.

    Needs ``steps >= 1`` and ``slots >= 1`` (ValueError otherwise).
    Oracles: ``advances(10, 2) == 20``, ``advances(1000, 50) == 1948``.
    """
    return _advances(_check("steps", steps, 1), _check("slots", slots, 1))


@lru_cache(maxsize=1 << 18)
def _reps(steps: int, slots: int) -> int:
    if slots == 1:  # beta(1, r) = r + 1
        return steps - 1
    if slots == 2:  # beta(2, r) = (r + 1)(r + 2)/2: start just below the root
        r = max(0, isqrt(2 * steps) - 2)
        while comb(r + 2, 2) < steps:
            r += 1
        return r
    r, value = 0, 1
    while value < steps:
        value = value * (slots + r + 1) // (r + 1)
        r += 1
    return r


@lru_cache(maxsize=1 << 18)
def _advances(steps: int, slots: int) -> int:
    r = _reps(steps, slots)
    return r * steps - (comb(slots + r, slots + 1) if r >= 1 else 0)


@lru_cache(maxsize=1 << 16)
def split(steps: int, slots: int) -> int:
    """An optimal length of the first advance when reversing ``steps`` steps with ``slots`` slots.

    Minimises ``m + advances(steps - m, slots - 1) + advances(m, slots)`` over ``1 <= m < steps``.
    The objective is convex in ``m`` (its increments are non-decreasing), so a binary search on
    the increments finds the least optimal ``m``. Needs ``steps >= 2`` and ``slots >= 2``.
    """
    if slots >= steps - 1:  # one repetition: store every state, m = 1
        return 1

    def total(m: int) -> int:
        return m + _advances(steps - m, slots - 1) + _advances(m, slots)

    lo, hi = 1, steps - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if total(mid + 1) >= total(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
