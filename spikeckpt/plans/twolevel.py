"""The optimal two-level schedule: device slots plus a remote tier whose checkpoints are re-read.

Cost model: a step evaluation costs ``forward_cost``, a remote write ``write_cost``, a remote
read ``read_cost`` (device stores and loads are free; every step is taped and backpropagated
once, ``backward_cost`` each). "Optimal" means the least modeled time among schedules that
tape one step at a time, use at most ``slots + 1`` device states (checkpoints, the working
state and the prefetch buffer) and an unlimited remote tier, where a remote checkpoint may be
read any number of times: H-Revolve's two-level optimum (Herrmann & Pallez 2020), computed by
`spikeckpt.plans.hrevolve`. It is never slower than the best single-read schedule
(Aupy et al.'s Disk-Revolve, this plan's previous definition) nor than plain Revolve.

Exact for ``T <= EXACT_LIMIT`` (5000). Beyond, the periodic form: ``k`` remote checkpoints
every ``d`` steps (``d = period()``, the segment length with the least time per step, or the
previous single-read period ``beta(s, t*)``), each segment reversed optimally, then the rest
solved from the table (exactly, or as one more segment of any length plus an exact rest);
``d`` and ``k`` are searched, plain Revolve is a candidate too. Measured against the exact
program up to ``T = 3*EXACT_LIMIT`` for slots 1-16 and write/read costs 1-1000 (45 settings):
equal at every length tried; with the exact range cut to 120 steps, within 3% (tests).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from spikeckpt.errors import ConfigError
from spikeckpt.plans.base import Plan, check_count, check_length
from spikeckpt.plans.binomial import advances, beta
from spikeckpt.plans.builders import (
    Lazy,
    RevolveBlock,
    Sweep,
    Unwind,
    remote_entry,
    revolve_parts,
)
from spikeckpt.plans.hrevolve import EXACT_LIMIT, TwoLevelTable, table
from spikeckpt.plans.revolve import Revolve
from spikeckpt.plans.schedule import (
    Action,
    Advance,
    Backprop,
    Block,
    Boundary,
    Free,
    Load,
    Prefetch,
    Schedule,
    Store,
    Tape,
)
from spikeckpt.plans.simulate import Cost, CostModel

__all__ = ["EXACT_LIMIT", "TwoLevel"]


def _check_cost(name: str, value: object, *, positive: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 <= value < math.inf
        or (positive and value == 0)
    ):
        need = "> 0" if positive else ">= 0"
        raise ConfigError(
            f"{name} must be a finite number {need} (time units, the same unit as the other "
            f"costs), got {value!r}"
        )
    return float(value)


class TwoLevel(Plan):
    """Remote checkpoints re-read as often as it pays, Revolve(``slots``) on the device.

    The schedule with the least modeled time for the given costs (see the module docstring
    for the cost model and what "optimal" covers). Device memory: at most
    ``(slots + 1)*S + A`` (the slots and the working state). The next remote read is
    prefetched into a device buffer as soon as a slot is free for it, near the end of each
    device stretch (with one slot: right before the read, so nothing overlaps).

    Args:
        slots: device checkpoint slots (a state loaded from the remote tier takes one when
            it is kept on the device).
        write_cost: time of one remote write, in the unit of ``forward_cost``.
        read_cost: time of one remote read, in the unit of ``forward_cost``.
        forward_cost: time of one step evaluation (> 0).
        backward_cost: time of backpropagating one step (only in [`modeled_time`][spikeckpt.plans.twolevel.TwoLevel.modeled_time]).
        remote_interval: force a remote checkpoint every ``remote_interval`` steps in the
            forward pass instead of the optimal spacing (each segment, and the remainder,
            is still reversed optimally). Clamped to ``T``.
    """

    uses_remote = True

    def __init__(
        self,
        slots: int,
        write_cost: float = 0.0,
        read_cost: float = 0.0,
        forward_cost: float = 1.0,
        backward_cost: float = 2.0,
        remote_interval: int | None = None,
    ) -> None:
        self.slots = check_count("slots", slots)
        self.write_cost = _check_cost("write_cost", write_cost)
        self.read_cost = _check_cost("read_cost", read_cost)
        self.forward_cost = _check_cost("forward_cost", forward_cost, positive=True)
        self.backward_cost = _check_cost("backward_cost", backward_cost)
        self.remote_interval = check_count("remote_interval", remote_interval, allow_none=True)

    @classmethod
    def asynchronous(
        cls, slots: int, write_cost: float, forward_cost: float = 1.0, read_cost: float = 0.0
    ) -> TwoLevel:
        """Kukreja et al.: a remote checkpoint as often as its write hides behind compute.

        The period is ``K = ceil(write_cost / forward_cost)`` steps (at least 1), optimal
        reversal in between.
        """
        write = _check_cost("write_cost", write_cost)
        forward = _check_cost("forward_cost", forward_cost, positive=True)
        period = max(1, math.ceil(write / forward))
        return cls(slots, write, read_cost, forward, remote_interval=period)

    def for_length(self, T: int) -> TwoLevel:
        T = check_length(T)
        if self.remote_interval is None or self.remote_interval <= T:
            return self
        return type(self)(
            self.slots,
            self.write_cost,
            self.read_cost,
            self.forward_cost,
            self.backward_cost,
            remote_interval=T,
        )

    # -- the optimum ---------------------------------------------------------------------

    #: Lengths up to which the optimum is exact (tests lower it in a subclass).
    _limit = EXACT_LIMIT

    def _table(self, length: int) -> TwoLevelTable:
        params = (self.slots, self.write_cost, self.read_cost, self.forward_cost, self._limit)
        return table(*params).fill(length)

    def _memory(self, length: int) -> float:
        return (length + advances(length, self.slots)) * self.forward_cost

    def _stretch(self, length: int, tab: TwoLevelTable) -> float:
        """``X``: time of ``length`` steps from a current state nothing holds yet."""
        return tab.X[length] if length <= tab.known else self._memory(length)

    def _segment(self, length: int, tab: TwoLevelTable) -> float:
        """Time of a middle segment: advance it, write its start, read it back, reverse it."""
        back = tab.R[length] if length <= tab.known else self._memory(length)
        return length * self.forward_cost + self.write_cost + self.read_cost + back

    def single_read_period(self) -> int:
        """The previous ``TwoLevel``'s periodic segment length ``beta(s, t*)``.

        ``t*`` is the least ``t`` with ``beta(s + 1, t) > (write + read) / forward``.
        """
        ratio = (self.write_cost + self.read_cost) / self.forward_cost
        t = 0
        while beta(self.slots + 1, t) <= ratio:
            t += 1
        return beta(self.slots, t)

    def period(self) -> int:
        """The periodic form's segment length: the least time per step of a middle segment.

        Searched over the lengths up to ``EXACT_LIMIT`` and [`single_read_period`][spikeckpt.plans.twolevel.TwoLevel.single_read_period].
        """
        tab = self._table(self._limit)
        candidates = dict.fromkeys([*range(1, tab.known + 1), self.single_read_period()])
        return min(candidates, key=lambda d: (self._segment(d, tab) / d, d))

    def _layout(self, T: int) -> tuple[tuple[tuple[int, int], ...], TwoLevelTable]:
        """``(runs, table)``: the forward pass's leading segments as ``(length, count)`` runs;
        the remaining ``T - sum`` steps are solved from the table (exactly up to its limit).
        """
        T = check_length(T)
        if self.remote_interval is not None:
            d = min(self.remote_interval, T)
            return (((d, (T - 1) // d),) if d < T else ()), self._table(d)
        tab = self._table(T)
        if tab.known >= T:
            return (), tab
        best: tuple[float, tuple[tuple[int, int], ...]] = (self._memory(T), ())  # Revolve
        for d in dict.fromkeys((self.period(), self.single_read_period())):
            segment = self._segment(d, tab)
            # every k whose rest (T - k*d) fits the table: solved exactly (at least one k:
            # with a period beyond the table, the rest is a Revolve stretch as before) ...
            last = (T - 1) // d
            first = min(max(1, -(-(T - tab.known) // d)), last)
            for k in range(first, last + 1):
                time = k * segment + self._stretch(T - k * d, tab)
                if time < best[0]:
                    best = (time, ((d, k),))
            # ... and one shorter k: the rest is one more segment of any length, then exact
            if d <= tab.known and first >= 1:
                time, j = tab.two_piece(T - (first - 1) * d)
                time += (first - 1) * segment
                if j and time < best[0]:
                    best = (time, ((d, first - 1), (j, 1)))
        return tuple(run for run in best[1] if run[1]), tab

    def segments(self, T: int) -> list[int]:
        """The forward pass's leading remote segments, then the rest (solved from the table).

        ``[T]`` when ``T <= EXACT_LIMIT`` and no ``remote_interval`` is forced.
        """
        runs, _ = self._layout(T)
        lengths = [d for d, k in runs for _ in range(k)]
        return [*lengths, T - sum(lengths)]

    def modeled_time(self, T: int) -> float:
        """The modeled time of `schedule` ``(T)``, in time units: forward steps, remote
        writes and reads at this plan's costs, plus ``T * backward_cost``.

        Equal to ``simulate(schedule(T), costs=CostModel(forward_cost, backward_cost,
        write_cost, read_cost)).time`` (up to float rounding).
        """
        runs, tab = self.for_length(T)._layout(T)
        lead = sum(d * k for d, k in runs)
        total = sum(k * self._segment(d, tab) for d, k in runs)
        return total + self._stretch(T - lead, tab) + T * self.backward_cost

    def cost(
        self, T: int, *, state_bytes: int = 1, step_bytes: int = 1, costs: CostModel | None = None
    ) -> Cost:
        """Counts and peaks of `schedule` ``(T)`` from the table, without building it."""
        plan = self.for_length(T)
        runs, tab = plan._layout(T)
        s = plan.slots
        rest = T - sum(d * k for d, k in runs)
        if not runs and _memory_only(tab, rest):
            return Revolve(s).cost(T, state_bytes=state_bytes, step_bytes=step_bytes, costs=costs)
        if runs:
            steps, writes, reads, remote, device = tab.stretch(rest)
            count = 0  # segments so far; during segment i's reversal, i + 1 of them are stored
            for d, k in runs:
                if d <= tab.known:
                    seg = (tab.steps[d], tab.writes[d], tab.reads[d], tab.remote_peak[d])
                    last, inner = tab.last[d], tab.inner[d]
                else:
                    seg, last, inner = (d + advances(d, s), 0, 0, 0), d, 0
                steps += k * (d + seg[0])
                writes += k * (1 + seg[1])
                reads += k * (1 + seg[2])
                remote = max(remote, count + k + seg[3])
                every = max(inner, min(s + 1, last + 1))  # prefetches the previous segment
                if count == 0:  # the first segment's last stretch ends the schedule
                    device = max(device, inner, min(s + 1, last), every if k >= 2 else 0)
                else:
                    device = max(device, every)
                count += k
            remote = max(remote, count + tab.stretch(rest)[3])
        else:  # x_0 written, then R(T); the very last device stretch prefetches nothing
            steps, writes, reads = tab.steps[T], 1 + tab.writes[T], tab.reads[T]
            remote = 1 + tab.remote_peak[T]
            device = max(tab.inner[T], min(s + 1, tab.last[T]))
        costs = costs or CostModel()
        return Cost(
            T=T,
            forward_steps=steps,
            backward_steps=T,
            peak_device_states=device,
            peak_taped_steps=1,
            remote_writes=writes,
            remote_reads=reads,
            peak_remote_states=remote,
            peak_bytes=device * state_bytes + step_bytes,
            time=steps * costs.forward
            + T * costs.backward
            + writes * costs.write
            + reads * costs.read
            + T * costs.segment,
            state_bytes=state_bytes,
            step_bytes=step_bytes,
            backprops=T,
        )

    # -- the schedule --------------------------------------------------------------------

    def schedule(self, T: int) -> Schedule:
        plan = self.for_length(T)
        runs, tab = plan._layout(T)
        rest = T - sum(d * k for d, k in runs)
        if not runs and _memory_only(tab, rest):
            parts: list[Action | Block] = revolve_parts(0, T, plan.slots)
        else:
            parts = [Lazy(0, T, _top, (runs, rest, tab, plan.slots))]
        return Schedule(T, parts, plan=repr(plan))


def _memory_piece(
    start: int, length: int, slots: int, then: int | None
) -> Iterator[Action | Block]:
    """Reverse ``[start, start+length)`` on the device from the current ``x_start``.

    Prefetches the remote ``x_then`` (the next remote read) into the device buffer as soon
    as a state is free for it, so the peak stays at ``slots + 1`` states: at once for one
    step, inside the reversal with two or more slots, after it with one slot.
    """
    if length == 1:
        if then is not None:
            yield Prefetch(then)
        yield Tape(start, start + 1)
        yield Backprop(start, start + 1)
        return
    yield Store(start, "device")
    if slots >= 2:
        yield RevolveBlock(start, start + length, slots, 1, then)
        yield Free(start, "device")
        return
    yield RevolveBlock(start, start + length, slots)
    yield Free(start, "device")
    if then is not None:
        yield Prefetch(then)


def _memory_only(tab: TwoLevelTable, length: int) -> bool:
    return length > tab.known or tab.memory[length]


def _chain(
    start: int, length: int, then: int | None, tab: TwoLevelTable, slots: int
) -> Iterator[Action | Block]:
    """``R``: reverse ``[start, start+length)`` from the current, remotely stored ``x_start``.

    Follows the table's splits: advance, write the next state remotely while the right part
    is longer than the device handles best, reverse the last part on the device, then
    re-read each remote checkpoint for the stretch left of it (`Node`).
    """
    j = tab.split[length] if length <= tab.known else 0
    if j == 0:
        yield from _memory_piece(start, length, slots, then)
        return
    chain = [start]
    pos, rest = start, length
    while True:
        yield Advance(pos, pos + j)
        pos, rest = pos + j, rest - j
        if _memory_only(tab, rest):
            break
        yield Store(pos, "remote")
        chain.append(pos)
        j = tab.split[rest]
    yield from _memory_piece(pos, rest, slots, chain[-1])
    ends = [*chain[1:], pos]
    for i in range(len(chain) - 1, -1, -1):
        yield Node(chain[i], ends[i], chain[i - 1] if i else then, tab, slots)
        if i:
            yield Free(chain[i], "remote")


@dataclass(frozen=True, slots=True)
class Node(Block):
    """Re-read the remote ``x_start`` (prefetched) and reverse ``[start, stop)`` optimally.

    Prefetches the remote ``x_then`` (the next read after this block) during its last
    device reversal, once a slot is free. Entry: ``x_start`` remote and prefetched (``x_then`` remote); exit: the
    same remote states, ``x_then`` prefetched.
    """

    start: int
    stop: int
    then: int | None
    table: TwoLevelTable
    slots: int

    @property
    def key(self) -> Hashable:
        offset = None if self.then is None else self.then - self.start
        return (self.table.key, self.slots, self.stop - self.start, offset)

    @property
    def entry(self) -> Boundary:
        return remote_entry(self.start, self.then)

    @property
    def exit(self) -> Boundary:
        entry = self.entry
        then = frozenset() if self.then is None else frozenset({self.then - self.start})
        return Boundary(stored=entry.stored, prefetched=then)

    def parts(self) -> Iterator[Action | Block]:
        yield Load(self.start, "remote")
        yield from _chain(self.start, self.stop - self.start, self.then, self.table, self.slots)


def _top(
    runs: tuple[tuple[int, int], ...], rest: int, tab: TwoLevelTable, slots: int
) -> Iterator[Action | Block]:
    """The whole two-level schedule: the leading segments (``(length, count)`` runs), each
    written remotely in the forward pass and re-read by a `Node`, then the rest."""
    if not runs:
        yield Store(0, "remote")
        yield from _chain(0, rest, None, tab, slots)
        yield Free(0, "remote")
        return
    starts, position = [], 0
    for d, k in runs:
        starts.append(position)
        yield Sweep(position, position + k * d, d)
        position += k * d
    previous = position - runs[-1][0]  # the last segment's start
    if _memory_only(tab, rest):
        yield from _memory_piece(position, rest, slots, previous)
    else:
        yield Store(position, "remote")
        yield from _chain(position, rest, previous, tab, slots)
        yield Free(position, "remote")
    for i in range(len(runs) - 1, -1, -1):
        (d, k), first = runs[i], starts[i]
        then = first - runs[i - 1][0] if i else None
        yield Unwind(first, first + k * d, d, then, _segment, (tab, slots))


def _segment(
    start: int, before: int | None, d: int, tab: TwoLevelTable, slots: int
) -> Iterator[Action | Block]:
    yield Node(start, start + d, before, tab, slots)
    yield Free(start, "remote")
