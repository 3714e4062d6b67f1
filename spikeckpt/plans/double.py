"""Double Checkpointing (Bencheikh, Finkbeiner & Neftci, arXiv 2412.11810), as defined here.

The paper's text is not available to us; this is our definition, built from its summary:
remote checkpoints off the device every ``K`` steps in the forward pass; in the backward pass
each remote segment is loaded back, run forward once laying local (device) checkpoints every
``k`` steps, and its sub-segments are recomputed taped in reverse.

Conventions (they fix the counts and the peak):
- The last remote segment is not written off the device: the forward pass lays its local
  checkpoints directly and keeps its last sub-segment taped.
- While a segment is reversed, the previous segment's remote checkpoint is prefetched into
  one device buffer (issued at the start of the segment, so the copy hides behind compute).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from spikeckpt.errors import ConfigError
from spikeckpt.plans.base import Plan, check_count, check_length, make_cost
from spikeckpt.plans.builders import Lazy, Sweep, Unwind, remote_entry, remote_handoff, sweep
from spikeckpt.plans.schedule import (
    Action,
    Block,
    Boundary,
    Free,
    Load,
    Prefetch,
    Schedule,
)
from spikeckpt.plans.simulate import Cost, CostModel
from spikeckpt.plans.uniform import Uniform


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Double(Plan):
    """Remote checkpoints every ``remote_interval`` steps, local ones every ``local_interval``.

    With ``K`` the remote and ``k`` the local interval, ``n = ceil(T/K)`` remote segments:
    device memory about ``2S + (K/k)*S + k*A`` independent of ``T``; remote tier ``n - 1``
    states; evaluations exactly ``3T - L - l - (n - 1)*k'`` (``= T + (L - l) + (n - 1)*(2K -
    k')``) where ``L`` is the last segment's length, ``l`` its last sub-segment's and ``k' =
    K - (ceil(K/k) - 1)*k`` the last sub-segment's length in a full segment. ``k' = k`` only
    when ``k`` divides ``K``; otherwise the count exceeds ``3T - (T/K)*k`` (default
    ``Double()`` at ``T = 1000``: 2928 > 2812.5), which is therefore only an approximation.

    Defaults: ``K = ceil(sqrt(T))``; ``k = round(sqrt(K*S/A))`` (the memory optimum) when
    ``state_bytes`` and ``step_bytes`` are given, else ``ceil(sqrt(K))``. ``K`` longer than
    ``T`` is clamped to ``T`` and ``k`` to ``K`` (``schedule``, ``cost`` and ``for_length``
    alike); an explicit ``k`` longer than an explicit ``K`` raises ValueError.

    Args:
        remote_interval: ``K``, steps between remote checkpoints.
        local_interval: ``k``, steps between local checkpoints inside a remote segment.
        state_bytes: ``S`` (bytes), only used for the default ``k``.
        step_bytes: ``A`` (bytes), only used for the default ``k``.
    """

    uses_remote = True

    def __init__(
        self,
        remote_interval: int | None = None,
        local_interval: int | None = None,
        *,
        state_bytes: int | None = None,
        step_bytes: int | None = None,
    ) -> None:
        self.remote_interval = check_count("remote_interval", remote_interval, allow_none=True)
        self.local_interval = check_count("local_interval", local_interval, allow_none=True)
        self.state_bytes = check_count("state_bytes", state_bytes, allow_none=True)
        self.step_bytes = check_count("step_bytes", step_bytes, allow_none=True)
        if (
            self.remote_interval is not None
            and self.local_interval is not None
            and self.local_interval > self.remote_interval
        ):
            raise ConfigError(
                f"local_interval={self.local_interval} is longer than "
                f"remote_interval={self.remote_interval}; pick local_interval <= remote_interval"
            )

    def for_length(self, T: int) -> Double:
        T = check_length(T)
        remote = self.remote_interval or math.isqrt(T - 1) + 1
        remote = min(remote, T)
        local = self.local_interval
        if local is None:
            if self.state_bytes and self.step_bytes:
                local = max(1, round(math.sqrt(remote * self.state_bytes / self.step_bytes)))
            else:
                local = math.isqrt(remote - 1) + 1
        return Double(remote, min(local, remote))

    def as_run(self, T: int) -> Plan:
        """``Uniform(local_interval)`` when the remote interval covers ``T`` (one segment, no
        remote checkpoint: the same schedule), else `for_length`."""
        plan = self.for_length(T)
        if plan.remote_interval is not None and plan.remote_interval >= T:
            return Uniform(plan.local_interval)
        return plan

    def schedule(self, T: int) -> Schedule:
        plan = self.for_length(T)
        K, k = plan.remote_interval, plan.local_interval
        assert K is not None and k is not None
        return Schedule(T, (Lazy(0, T, _double, (T, K, k)),), plan=repr(plan))

    def cost(
        self, T: int, *, state_bytes: int = 1, step_bytes: int = 1, costs: CostModel | None = None
    ) -> Cost:
        T = check_length(T)
        plan = self.for_length(T)
        K, k = plan.remote_interval, plan.local_interval
        assert K is not None and k is not None
        segments = _ceil_div(T, K)
        last_length = T - (segments - 1) * K
        last_subs = _ceil_div(last_length, k)
        last_tail = last_length - (last_subs - 1) * k
        prefetch_last = 1 if segments > 1 else 0
        units: list[tuple[int, int]] = [(last_subs + prefetch_last, last_tail)]
        if last_subs >= 2:
            units.append((last_subs + prefetch_last, k))
        forward_steps = T + (last_length - last_tail)
        backprops = last_subs
        if segments > 1:
            full_subs = _ceil_div(K, k)
            full_tail = K - (full_subs - 1) * k
            prefetch_full = 1 if segments > 2 else 0
            units.append((full_subs + prefetch_full, full_tail))
            if full_subs >= 2:
                units.append((full_subs + prefetch_full, k))
            forward_steps += (segments - 1) * (2 * K - full_tail)
            backprops += (segments - 1) * full_subs
        return make_cost(
            T,
            forward_steps=forward_steps,
            backprops=backprops,
            peak_states=max(states for states, _ in units),
            peak_taped=max(taped for _, taped in units),
            peak_units=tuple(units),
            remote=segments - 1,
            state_bytes=state_bytes,
            step_bytes=step_bytes,
            costs=costs,
        )


def _double(T: int, K: int, k: int) -> Iterator[Action | Block]:
    last = (T - 1) // K * K
    if last:
        yield Sweep(0, last, K)
        yield Prefetch(last - K)
    yield from sweep(last, T, k)
    if last:
        yield Unwind(0, last, K, None, _segment, (k,))


def _segment(start: int, before: int | None, K: int, k: int) -> Iterator[Action | Block]:
    yield Segment(start, start + K, k, before)


@dataclass(frozen=True, slots=True)
class Segment(Block):
    """Load the prefetched remote ``x_start``, prefetch ``x_then``, sweep with local interval ``k``.

    Entry: ``x_start`` (and ``x_then``) remote, ``x_start`` prefetched; exit: ``x_then``
    remote and prefetched (``x_start`` is freed).
    """

    start: int
    stop: int
    local: int
    then: int | None

    @property
    def key(self) -> Hashable:
        return (self.stop - self.start, self.local, self.then is None)

    @property
    def entry(self) -> Boundary:
        return remote_entry(self.start, self.then)

    @property
    def exit(self) -> Boundary:
        return remote_handoff(self.start, self.then)

    def parts(self) -> Iterator[Action | Block]:
        yield Load(self.start, "remote")
        yield Free(self.start, "remote")
        if self.then is not None:
            yield Prefetch(self.then)
        yield from sweep(self.start, self.stop, self.local)
