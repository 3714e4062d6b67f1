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


def reverse(start: int, stop: int, slots: int, out: list[Action]) -> None:
    """Append Griewank's binomial reversal of ``[start, stop)`` to ``out``.

    Precondition: the current state is ``x_start`` and it is stored on the device in one of
    the ``slots`` slots; it stays stored (the caller frees it). Uses at most ``slots`` device
    checkpoints and exactly ``advances(stop - start, slots)`` untaped evaluations.
    """
    while True:
        length = stop - start
        if length == 1:
            out += [Tape(start, stop), Backprop(start, stop)]
            return
        if slots == 1:
            for end in range(stop, start, -1):
                if end != stop:
                    out.append(Load(start, "device"))
                if end - 1 > start:
                    out.append(Advance(start, end - 1))
                out += [Tape(end - 1, end), Backprop(end - 1, end)]
            return
        middle = start + split(length, slots)
        out += [Advance(start, middle), Store(middle, "device")]
        reverse(middle, stop, slots - 1, out)
        out += [Free(middle, "device"), Load(start, "device")]
        stop = middle
