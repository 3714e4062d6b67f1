"""The optimal two-level schedule: remote checkpoints, Revolve with device slots in between.

Aupy & Herrmann (periodicity of optimal hierarchical checkpointing) and Herrmann & Pallez
(H-Revolve) show that the optimal schedule with a cheap-but-small device tier and an
expensive-but-large remote tier writes remote checkpoints at the start of segments and
reverses each segment with binomial checkpointing in the device slots. Kukreja et al.'s
asynchronous multistage scheme is the same shape with the period set by the copy time.

Segment lengths are chosen to minimise the modeled time. For ``T <= EXACT_LIMIT`` the optimum
over all segmentations is exact: a non-last segment of length ``l`` costs
``(2l + t(l, s))*forward + write + read`` and the last ``(l + t(l, s))*forward``; both are
convex in ``l``, so for a fixed number of segments balanced lengths are optimal and the last
segment's length is found by a convex search. Beyond, the periodic closed form is used:
period ``m = beta(s, t*)`` with ``t*`` the least ``t`` such that
``beta(s + 1, t) > (write + read) / forward``.
"""

from __future__ import annotations

import math

from spikeckpt.plans.base import Plan, check_count, check_length, check_within, make_cost
from spikeckpt.plans.binomial import advances, beta
from spikeckpt.plans.builders import reverse
from spikeckpt.plans.schedule import Action, Advance, Free, Load, Prefetch, Schedule, Store
from spikeckpt.plans.simulate import Cost, CostModel

EXACT_LIMIT = 5000


def _check_cost(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)


class TwoLevel(Plan):
    """Remote checkpoints at segment starts, Revolve(``slots``) on the device inside segments.

    Args:
        slots: device checkpoint slots used by Revolve inside a segment (the loaded remote
            state takes one).
        write_cost: time of one remote write, in the unit of ``forward_cost``.
        read_cost: time of one remote read, in the unit of ``forward_cost``.
        forward_cost: time of one step evaluation.
        backward_cost: time of backpropagating one step.
        remote_interval: force a fixed segment length instead of the optimum.
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
        self.forward_cost = _check_cost("forward_cost", forward_cost)
        if self.forward_cost == 0:
            raise ValueError("forward_cost must be > 0")
        self.backward_cost = _check_cost("backward_cost", backward_cost)
        self.remote_interval = check_count("remote_interval", remote_interval, allow_none=True)

    @classmethod
    def asynchronous(
        cls, slots: int, write_cost: float, forward_cost: float = 1.0, read_cost: float = 0.0
    ) -> TwoLevel:
        """Kukreja et al.: a remote checkpoint as often as its write hides behind compute.

        The period is ``K = ceil(write_cost / forward_cost)`` steps, Revolve in between.
        """
        period = max(1, math.ceil(_check_cost("write_cost", write_cost) / forward_cost))
        return cls(slots, write_cost, read_cost, forward_cost, remote_interval=period)

    def for_length(self, T: int) -> TwoLevel:
        T = check_length(T)
        if self.remote_interval is None or self.remote_interval <= T:
            return self
        return TwoLevel(
            self.slots,
            self.write_cost,
            self.read_cost,
            self.forward_cost,
            self.backward_cost,
            remote_interval=T,
        )

    def period(self) -> int:
        """The periodic closed form's segment length ``beta(s, t*)``."""
        ratio = (self.write_cost + self.read_cost) / self.forward_cost
        t = 0
        while beta(self.slots + 1, t) <= ratio:
            t += 1
        return beta(self.slots, t)

    def segments(self, T: int) -> list[int]:
        """Segment lengths for ``T`` steps, last segment last."""
        T = check_length(T)
        if self.remote_interval is not None:
            return _fixed(T, min(self.remote_interval, T))
        if T <= EXACT_LIMIT:
            return self._optimal_segments(T)
        return _fixed(T, self.period())

    def _optimal_segments(self, T: int) -> list[int]:
        s, f = self.slots, self.forward_cost
        transfer = self.write_cost + self.read_cost

        def middle(length: int) -> float:
            return (2 * length + advances(length, s)) * f + transfer

        def balanced(total: int, count: int) -> float:
            q, rem = divmod(total, count)
            return rem * middle(q + 1) + (count - rem) * middle(q) if q else math.inf

        def with_last(last: int, count: int) -> float:
            return (last + advances(last, s)) * f + balanced(T - last, count)

        best_time, best = (T + advances(T, s)) * f, (0, T)
        for count in range(1, T):
            if count * transfer + (2 * T - 1) * f >= best_time:  # a lower bound, rising in count
                break
            lo, hi = 1, T - count
            while lo < hi:
                mid = (lo + hi) // 2
                if with_last(mid + 1, count) >= with_last(mid, count):
                    hi = mid
                else:
                    lo = mid + 1
            time = with_last(lo, count)
            if time < best_time:
                best_time, best = time, (count, lo)
        count, last = best
        if count == 0:
            return [T]
        q, rem = divmod(T - last, count)
        return [q + 1] * rem + [q] * (count - rem) + [last]

    def schedule(self, T: int) -> Schedule:
        T = check_length(T)
        check_within("remote_interval", self.remote_interval, T)
        lengths = self.segments(T)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        actions: list[Action] = []
        for first, length in zip(starts[:-1], lengths[:-1], strict=True):
            actions += [Store(first, "remote"), Advance(first, first + length)]
        if len(starts) > 1:
            actions.append(Prefetch(starts[-2]))
        actions.append(Store(starts[-1], "device"))
        reverse(starts[-1], T, self.slots, actions)
        actions.append(Free(starts[-1], "device"))
        for position in range(len(starts) - 2, -1, -1):
            first, length = starts[position], lengths[position]
            actions += [Load(first, "remote"), Free(first, "remote")]
            if position > 0:
                actions.append(Prefetch(starts[position - 1]))
            actions.append(Store(first, "device"))
            reverse(first, first + length, self.slots, actions)
            actions.append(Free(first, "device"))
        return Schedule(T, tuple(actions), plan=repr(self))

    def cost(
        self, T: int, *, state_bytes: int = 1, step_bytes: int = 1, costs: CostModel | None = None
    ) -> Cost:
        lengths = self.segments(T)
        s, n = self.slots, len(lengths)
        forward_steps = lengths[-1] + advances(lengths[-1], s)
        forward_steps += sum(2 * length + advances(length, s) for length in lengths[:-1])
        units = {(min(s, lengths[-1]) + 1 + (1 if n > 1 else 0), 1)}
        units |= {
            (min(s, length) + 1 + (1 if i > 0 else 0), 1) for i, length in enumerate(lengths[:-1])
        }
        return make_cost(
            T,
            forward_steps=forward_steps,
            backprops=T,
            peak_states=max(states for states, _ in units),
            peak_taped=1,
            peak_units=tuple(units),
            remote=n - 1,
            state_bytes=state_bytes,
            step_bytes=step_bytes,
            costs=costs,
        )


def _fixed(T: int, period: int) -> list[int]:
    count = -(-T // period)
    return [period] * (count - 1) + [T - (count - 1) * period]
