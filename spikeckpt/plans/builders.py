"""Building blocks that emit action lists: the local sweep and the binomial reversal."""

from __future__ import annotations

from spikeckpt.plans.binomial import split
from spikeckpt.plans.schedule import Action, Advance, Backprop, Free, Load, Store, Tape


def sweep(start: int, stop: int, interval: int) -> tuple[list[Action], list[Action]]:
    """Checkpoint ``[start, stop)`` on the device every ``interval`` steps (Chen et al.).

    Returns ``(forward, backward)``. ``forward`` assumes the current state is ``x_start``; it
    stores the start of every sub-segment except the last on the device and tapes the last
    sub-segment. ``backward`` backpropagates that tape, then recomputes each earlier
    sub-segment taped from its checkpoint, in reverse, freeing the checkpoints as it goes.
    """
    starts = list(range(start, stop, interval))
    forward: list[Action] = []
    for first in starts[:-1]:
        forward += [Store(first, "device"), Advance(first, first + interval)]
    forward.append(Tape(starts[-1], stop))
    backward: list[Action] = [Backprop(starts[-1], stop)]
    for first in reversed(starts[:-1]):
        last = first + interval
        backward += [
            Load(first, "device"),
            Tape(first, last),
            Backprop(first, last),
            Free(first, "device"),
        ]
    return forward, backward


def reverse(start: int, stop: int, slots: int, out: list[Action], *, unit: int = 1) -> None:
    """Append Griewank's binomial reversal of ``[start, stop)`` to ``out``.

    The reversal works on units of ``unit`` steps (the last unit may be shorter): checkpoints
    sit on unit boundaries and each unit is taped and backpropagated as one segment. With
    ``unit=1`` this is the classic single-step Revolve.

    Precondition: the current state is ``x_start`` and it is stored on the device in one of
    the ``slots`` slots; it stays stored (the caller frees it). Uses at most ``slots`` device
    checkpoints and exactly ``advances(units, slots)`` untaped unit evaluations, where
    ``units = ceil((stop - start) / unit)``.
    """

    def at(i: int) -> int:  # the step where unit i starts
        return min(start + i * unit, stop)

    def units(lo: int, hi: int, slots: int) -> None:
        while True:
            length = hi - lo
            if length == 1:
                out.extend([Tape(at(lo), at(hi)), Backprop(at(lo), at(hi))])
                return
            if slots == 1:
                for end in range(hi, lo, -1):
                    if end != hi:
                        out.append(Load(at(lo), "device"))
                    if end - 1 > lo:
                        out.append(Advance(at(lo), at(end - 1)))
                    out.extend([Tape(at(end - 1), at(end)), Backprop(at(end - 1), at(end))])
                return
            middle = lo + split(length, slots)
            out.extend([Advance(at(lo), at(middle)), Store(at(middle), "device")])
            units(middle, hi, slots - 1)
            out.extend([Free(at(middle), "device"), Load(at(lo), "device")])
            hi = middle

    units(0, -(-(stop - start) // unit), slots)
