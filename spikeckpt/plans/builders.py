"""Building blocks that emit actions lazily: the local sweep and the binomial reversal."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from spikeckpt.errors import ConfigError
from spikeckpt.plans.binomial import split
from spikeckpt.plans.schedule import (
    Action,
    Advance,
    Backprop,
    Block,
    Boundary,
    Free,
    Load,
    Prefetch,
    Store,
    Tape,
)

_DEVICE_START = Boundary(current=0, stored=frozenset({(0, "device")}))
_DEVICE_KEPT = Boundary(stored=frozenset({(0, "device")}))


def remote_entry(start: int, then: int | None) -> Boundary:
    """Entry of a segment that starts from its own remote checkpoint, prefetched at offset 0,
    while the next segment's (at ``then``, if any) stays stored."""
    stored = {(0, "remote")}
    if then is not None:
        stored.add((then - start, "remote"))
    return Boundary(stored=frozenset(stored), prefetched=frozenset({0}))  # type: ignore[arg-type]


def remote_handoff(start: int, then: int | None) -> Boundary:
    """Exit of a segment that leaves the next segment's remote checkpoint (at ``then``)
    stored and prefetched; nothing when there is no next segment."""
    if then is None:
        return Boundary()
    offset = then - start
    return Boundary(
        stored=frozenset({(offset, "remote")}),  # type: ignore[arg-type]
        prefetched=frozenset({offset}),
    )


@dataclass(frozen=True, slots=True)
class Lazy(Block):
    """A block that only defers its expansion: ``build(*args)`` yields its parts (never reused)."""

    start: int
    stop: int
    build: Callable[..., Iterator[Action | Block]]
    args: tuple[Any, ...] = ()

    def parts(self) -> Iterator[Action | Block]:
        return self.build(*self.args)


@dataclass(frozen=True, slots=True)
class RevolveBlock(Block):
    """Griewank's binomial reversal of ``[start, stop)`` in units of ``unit`` steps.

    Checkpoints sit on unit boundaries and each unit is taped and backpropagated as one
    segment (the last unit may be shorter); ``unit=1`` is the classic single-step Revolve.

    Entry: the current state is ``x_start`` and it is stored on the device in one of the
    ``slots`` slots; it stays stored (the caller frees it). Uses at most ``slots`` device
    checkpoints and exactly ``advances(units, slots)`` untaped unit evaluations, with
    ``units = ceil((stop - start) / unit)``. A unit that is only taped right after an advance
    is never stored: its start is the working state.

    With ``then`` (``slots >= 2``), the remote ``x_then`` is prefetched as soon as a device
    state is free for its buffer: once the rest of the reversal spans at most ``slots - 1``
    units beyond ``x_start`` (it then needs at most ``slots`` states), so the peak stays at
    ``slots + 1`` states while the copy overlaps that last stretch. Entry and exit then also
    hold the remote ``x_then``; at exit it is prefetched.
    """

    start: int
    stop: int
    slots: int
    unit: int = 1
    then: int | None = None

    @property
    def key(self) -> Hashable:
        n = -(-(self.stop - self.start) // self.unit)
        then = None if self.then is None else self.then - self.start
        return (n, self.slots, self.unit, self.stop - self.start - (n - 1) * self.unit, then)

    @property
    def entry(self) -> Boundary:
        if self.then is None:
            return _DEVICE_START
        remote = (self.then - self.start, "remote")
        return Boundary(current=0, stored=frozenset({(0, "device"), remote}))  # type: ignore[arg-type]

    @property
    def exit(self) -> Boundary:
        if self.then is None:
            return _DEVICE_KEPT
        offset = self.then - self.start
        stored = frozenset({(0, "device"), (offset, "remote")})
        return Boundary(stored=stored, prefetched=frozenset({offset}))  # type: ignore[arg-type]

    def parts(self) -> Iterator[Action | Block]:
        start, stop, unit = self.start, self.stop, self.unit

        def at(i: int) -> int:  # the step where unit i starts
            return min(start + i * unit, stop)

        lo, hi, slots = 0, -(-(stop - start) // unit), self.slots
        then = self.then
        if then is not None and slots < 2:
            raise ConfigError("RevolveBlock can prefetch only with 2 or more slots")
        while True:
            if then is not None and hi - lo <= slots:  # x_lo stored, the rest fits in slots
                yield Prefetch(then)
                then = None
            if hi - lo == 1:
                yield Tape(at(lo), at(hi))
                yield Backprop(at(lo), at(hi))
                return
            if slots == 1:
                for end in range(hi, lo, -1):
                    if end != hi:
                        yield Load(at(lo), "device")
                    if end - 1 > lo:
                        yield Advance(at(lo), at(end - 1))
                    yield Tape(at(end - 1), at(end))
                    yield Backprop(at(end - 1), at(end))
                return
            middle = lo + split(hi - lo, slots)
            yield Advance(at(lo), at(middle))
            if hi - middle == 1:  # one unit: tape it from the working state, no checkpoint
                yield Tape(at(middle), at(hi))
                yield Backprop(at(middle), at(hi))
            else:
                yield Store(at(middle), "device")
                yield RevolveBlock(at(middle), at(hi), slots - 1, unit)
                yield Free(at(middle), "device")
            yield Load(at(lo), "device")
            hi = middle


def revolve_parts(start: int, stop: int, slots: int, unit: int = 1) -> list[Action | Block]:
    """Reverse ``[start, stop)`` from the current state ``x_start``, which nothing else holds.

    One unit is simply taped; longer stretches store ``x_start`` on the device (it takes one
    of the ``slots``), run `RevolveBlock` and free it.
    """
    if stop - start <= unit:
        return [Tape(start, stop), Backprop(start, stop)]
    return [
        Store(start, "device"),
        RevolveBlock(start, stop, slots, unit),
        Free(start, "device"),
    ]


def sweep(start: int, stop: int, interval: int) -> Iterator[Action]:
    """Checkpoint ``[start, stop)`` on the device every ``interval`` steps (Chen et al.).

    Assumes the current state is ``x_start``. The forward part stores the start of every
    sub-segment except the last on the device and tapes the last sub-segment; the backward
    part backpropagates that tape, then recomputes each earlier sub-segment taped from its
    checkpoint, in reverse, freeing the checkpoints as it goes. Lazy: memory does not grow
    with the number of sub-segments.
    """
    last = start + (stop - 1 - start) // interval * interval
    for first in range(start, last, interval):
        yield Store(first, "device")
        yield Advance(first, first + interval)
    yield Tape(last, stop)
    yield Backprop(last, stop)
    for first in range(last - interval, start - 1, -interval):
        end = first + interval
        yield Load(first, "device")
        yield Tape(first, end)
        yield Backprop(first, end)
        yield Free(first, "device")


#: Runs of at most this many segments are emitted segment by segment.
_LEAF = 4


@dataclass(frozen=True, slots=True)
class Sweep(Block):
    """Forward pass of a periodic run: write ``x_p`` remotely and advance ``stride`` steps,
    for ``p = start, start + stride, ... < stop``; ends on the working state ``x_stop``.

    A balanced tree of halves, so equal halves share one simulated shape.
    """

    start: int
    stop: int
    stride: int

    @property
    def key(self) -> Hashable:
        return ("sweep", (self.stop - self.start) // self.stride, self.stride)

    @property
    def entry(self) -> Boundary:
        return Boundary(current=0)

    @property
    def exit(self) -> Boundary:
        span = self.stop - self.start
        return Boundary(current=span, runs=((0, span, self.stride, "remote"),))

    def parts(self) -> Iterator[Action | Block]:
        d = self.stride
        n = (self.stop - self.start) // d
        if n <= _LEAF:
            for p in range(self.start, self.stop, d):
                yield Store(p, "remote")
                yield Advance(p, p + d)
            return
        middle = self.start + n // 2 * d
        yield Sweep(self.start, middle, d)
        yield Sweep(middle, self.stop, d)


@dataclass(frozen=True, slots=True)
class Unwind(Block):
    """Backward pass of a periodic run: the segments ``[p, p + stride)`` in reverse, each by
    ``body(p, before, stride, *args)``, where ``before`` is the previous segment's start (the
    run's ``then`` for its first segment).

    The body must re-read and free the remote ``x_p`` and leave ``x_before`` prefetched
    (TwoLevel's `Node` + Free, Double's segment). Entry: every
    segment start remote, the last one prefetched; exit: ``x_then`` remote and prefetched. A
    balanced tree of halves, so equal halves share one simulated shape.
    """

    start: int
    stop: int
    stride: int
    then: int | None
    body: Callable[..., Iterator[Action | Block]]
    args: tuple[Any, ...] = ()

    @property
    def key(self) -> Hashable:
        then = None if self.then is None else self.then - self.start
        return ("unwind", (self.stop - self.start) // self.stride, self.stride, then, self.body,
                self.args)  # fmt: skip

    @property
    def entry(self) -> Boundary:
        span = self.stop - self.start
        then = frozenset() if self.then is None else frozenset({(self.then - self.start, "remote")})
        return Boundary(
            stored=then,  # type: ignore[arg-type]
            prefetched=frozenset({span - self.stride}),
            runs=((0, span, self.stride, "remote"),),
        )

    @property
    def exit(self) -> Boundary:
        return remote_handoff(self.start, self.then)

    def parts(self) -> Iterator[Action | Block]:
        d = self.stride
        n = (self.stop - self.start) // d
        if n <= _LEAF:
            for p in range(self.stop - d, self.start - 1, -d):
                yield from self.body(p, p - d if p > self.start else self.then, d, *self.args)
            return
        middle = self.start + n // 2 * d
        yield Unwind(middle, self.stop, d, middle - d, self.body, self.args)
        yield Unwind(self.start, middle, d, self.then, self.body, self.args)
