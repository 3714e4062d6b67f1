"""The two-level optimum with re-reads: H-Revolve's dynamic program (Herrmann & Pallez).

Herrmann & Pallez, "H-Revolve: a framework for adjoint computation on synchronous
hierarchical platforms", ACM TOMS 46(2), 2020, for two tiers: ``s`` device slots and an
unlimited remote tier. Cost model (our action vocabulary, `spikeckpt.plans.simulate`):
every step evaluation (advance or taped) costs ``f``, every remote write ``w``, every remote
read ``r``; device stores and loads are free; each step is taped and backpropagated once
(``T * backward`` is the same for every schedule and left out here). All times below are in
those time units.

For a stretch of ``l`` steps whose first state ``x_0`` is stored remotely and is the current
state (just written or just read), with every device slot free:

- ``Q(l) = (l + t(l, s)) * f``: store ``x_0`` on the device and reverse with Revolve in the
  ``s`` slots (Griewank & Walther's binomial optimum, the memory level's closed form);
- ``R(l) = min(Q(l), min_{1<=j<l} j*f + X(l - j) + r + R(j))``: advance ``j`` steps, reverse
  the right part ``[j, l)``, read ``x_0`` back (``r``) and reverse ``[0, j)`` the same way:
  ``x_0`` may be **read many times**;
- ``X(p) = min(Q(p), w + R(p))``: the right part either stays on the device (Revolve from
  ``x_j``) or ``x_j`` is written remotely (``w``) and the stretch is solved recursively.

The optimal time for ``T`` steps is ``X(T)`` (``Q(T)`` is plain Revolve, no remote tier).
Single-read schedules (Aupy et al.'s Disk-Revolve, the previous ``TwoLevel``) are the
special case where ``R(j)`` after a read is always ``Q(j)``. The tests check ``X`` against an
independent brute-force dynamic program over a larger class (the device may keep ``x_0``
while remote sub-problems run, a state may be held in both tiers) for ``T <= 60``, slots 1-4:
they agree everywhere.

`TwoLevelTable` fills ``R`` and ``X`` up to a length on demand, in ``O(l)`` per length
at worst: the split ``j`` is searched in increasing order, in chunks evaluated at C speed,
and the search stops once a lower bound of every remaining term exceeds the best found.
With ``c`` any slope, ``a = min R(i) - c*i`` and ``b = min X(i) - c*i`` over the lengths
already known, each remaining term is at least ``j*f + r + c*l + a + b`` (exact pruning:
the result does not depend on ``c``; ``c`` tracks the observed slope to make it tight).
"""

from __future__ import annotations

import math
import threading
from functools import lru_cache
from operator import add

from spikeckpt.plans.binomial import _advances as advances

#: Lengths up to which [`TwoLevel`][spikeckpt.plans.twolevel.TwoLevel] uses the exact optimum.
EXACT_LIMIT = 5000

_CHUNK = 32


class TwoLevelTable:
    """Optimal two-level times for one ``(slots, write, read, forward)``, grown on demand.

    Never filled beyond ``limit`` steps, so what a plan decides does not depend on how far
    an earlier call filled the shared table.

    Attributes (lists indexed by length ``l``, entry 0 unused):
        Q: memory-only time ``(l + t(l, s)) * f``.
        R: optimal time from a remote, current ``x_0`` (re-reads allowed).
        X: optimal time from a current ``x_0`` that nothing stores yet.
        split: the first advance ``j`` of ``R(l)`` (0: memory-only, ``R(l) = Q(l)``).
        memory: whether ``X(l)`` keeps the stretch on the device (no remote write).

    And the counts of the schedule `spikeckpt.plans.twolevel` builds for ``R(l)`` (not
    counting ``x_0`` itself): ``steps`` (evaluations), ``writes`` and ``reads`` (remote),
    ``remote_peak`` (most other remote states alive at once), ``last`` (the length of the
    last device stretch, the one that prefetches nothing when it ends the schedule) and
    ``inner`` (the most device states of every other device stretch, each holding one
    prefetch buffer once a slot is free: ``min(s + 1, n + 1)`` for ``n`` steps; 0 when there
    is none).
    """

    def __init__(
        self, slots: int, write: float, read: float, forward: float, limit: int = EXACT_LIMIT
    ) -> None:
        self.params = (slots, write, read, forward)
        self.limit = limit
        self.Q: list[float] = [0.0]
        self.R: list[float] = [0.0]
        self.X: list[float] = [0.0]
        self.G: list[float] = [0.0]  # j*f + r + R(j): the cost of coming back for [0, j)
        self.split: list[int] = [0]
        self.memory: list[bool] = [True]
        self.steps: list[int] = [0]
        self.writes: list[int] = [0]
        self.reads: list[int] = [0]
        self.remote_peak: list[int] = [0]
        self.last: list[int] = [0]
        self.inner: list[int] = [0]
        self._slope: float | None = None
        self._low_r = self._low_x = 0.0
        self._lock = threading.Lock()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TwoLevelTable) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        s, w, r, f = self.params
        return (
            f"TwoLevelTable(slots={s}, write={w}, read={r}, forward={f}, limit={self.limit}, "
            f"known={self.known})"
        )

    def __getstate__(self) -> tuple[tuple[int, float, float, float, int], int]:
        return self.key, self.known  # recomputed on unpickling: small and deterministic

    def __setstate__(self, state: tuple[tuple[int, float, float, float, int], int]) -> None:
        key, known = state
        self.__init__(*key)  # type: ignore[misc]
        self.fill(known)

    @property
    def key(self) -> tuple[int, float, float, float, int]:
        """``(slots, write, read, forward, limit)``: what the table depends on."""
        return (*self.params, self.limit)

    @property
    def known(self) -> int:
        """The longest length computed so far."""
        return len(self.R) - 1

    def fill(self, length: int) -> TwoLevelTable:
        """Compute the table up to ``min(length, limit)`` steps; returns ``self``."""
        length = min(length, self.limit)
        if length <= self.known:
            return self
        with self._lock:
            self._fill(length)
        return self

    def _fill(self, length: int) -> None:
        s, w, r, f = self.params
        Q, R, X, G, split, memory = self.Q, self.R, self.X, self.G, self.split, self.memory
        for l in range(len(R), length + 1):  # noqa: E741 - l is the paper's length
            q = (l + advances(l, s)) * f
            best, arg = q, 0
            if l > 1:
                c = self._slope
                base = -math.inf if c is None else r + c * l + self._low_r + self._low_x
                j0 = 1
                while j0 < l and j0 * f + base < best:
                    j1 = min(l, j0 + _CHUNK) if c is not None else l
                    # terms j*f + r + R(j) + X(l - j) for j in [j0, j1)
                    terms = list(map(add, G[j0:j1], reversed(X[l - j1 + 1 : l - j0 + 1])))
                    low = min(terms)
                    if low < best:
                        best, arg = low, j0 + terms.index(low)
                    j0 = j1
            Q.append(q)
            R.append(best)
            split.append(arg)
            G.append(l * f + r + best)
            X.append(min(q, w + best))
            memory.append(q <= w + best)
            self._count(l, arg)
            self._track(l)

    def stretch(self, length: int) -> tuple[int, int, int, int, int]:
        """Counts of ``X(length)``: ``(steps, writes, reads, remote peak, device peak)``.

        The device peak counts the prefetch buffer, which a device stretch of ``n`` steps
        holds once a slot is free: ``min(s + 1, n + 1)`` states. Lengths beyond the table are
        kept on the device (Revolve).
        """
        s = self.params[0]
        if length > self.known or self.memory[length]:
            return length + advances(length, s), 0, 0, 0, min(s + 1, length + 1)
        return (
            self.steps[length],
            1 + self.writes[length],
            self.reads[length],
            1 + self.remote_peak[length],
            max(self.inner[length], min(s + 1, self.last[length] + 1)),
        )

    def two_piece(self, length: int) -> tuple[float, int]:
        """``(time, j)``: the best ``j*f + w + r + R(j) + X(length - j)`` with both in the table.

        A segment of ``j`` steps (written, re-read and reversed by ``R``) and the exact rest:
        the optimum for ``length`` up to ``2*known`` when the first segment fits the table.
        ``(inf, 0)`` when no split fits.
        """
        lo, hi = max(1, length - self.known), min(self.known, length - 1)
        if lo > hi:
            return math.inf, 0
        X, G = self.X, self.G
        terms = list(map(add, G[lo : hi + 1], reversed(X[length - hi : length - lo + 1])))
        best = min(terms)
        return best + self.params[1], lo + terms.index(best)

    def _count(self, l: int, j: int) -> None:  # noqa: E741
        if j == 0:
            self.steps.append(l + advances(l, self.params[0]))
            self.writes.append(0)
            self.reads.append(0)
            self.remote_peak.append(0)
            self.inner.append(0)
            self.last.append(l)
            return
        steps, writes, reads, remote, device = self.stretch(l - j)
        self.steps.append(j + steps + self.steps[j])
        self.writes.append(writes + self.writes[j])
        self.reads.append(reads + 1 + self.reads[j])
        self.remote_peak.append(max(remote, self.remote_peak[j]))
        self.inner.append(max(device, self.inner[j]))
        self.last.append(self.last[j])

    def _track(self, l: int) -> None:  # noqa: E741
        """Keep the pruning bound's slope and offsets up to date (exact for any slope)."""
        R, X = self.R, self.X
        if l >= 64 and l & (l - 1) == 0:  # re-fit the slope at powers of two
            c = (R[l] - R[l // 2]) / (l - l // 2)
            self._slope = c
            self._low_r = min(R[i] - c * i for i in range(1, l + 1))
            self._low_x = min(X[i] - c * i for i in range(1, l + 1))
        elif self._slope is not None:
            c = self._slope
            self._low_r = min(self._low_r, R[l] - c * l)
            self._low_x = min(self._low_x, X[l] - c * l)


@lru_cache(maxsize=64)
def table(
    slots: int, write: float, read: float, forward: float, limit: int = EXACT_LIMIT
) -> TwoLevelTable:
    """The shared (cached) table for these slots and costs; fill it with ``.fill(length)``."""
    return TwoLevelTable(slots, write, read, forward, limit)
