"""Optimal binomial checkpointing (Griewank & Walther's Revolve) with ``slots`` device slots."""

from __future__ import annotations

from spikeckpt.plans.base import Plan, check_count, check_length, make_cost
from spikeckpt.plans.binomial import advances
from spikeckpt.plans.builders import revolve_parts
from spikeckpt.plans.schedule import Schedule
from spikeckpt.plans.simulate import Cost, CostModel


class Revolve(Plan):
    """Binomial checkpointing: the fewest evaluations for a given number of device slots.

    ``x_0`` takes one of the ``slots``. The reversal works on units of ``tape`` steps (the
    last unit may be shorter): checkpoints sit on unit boundaries and each unit is taped and
    backpropagated as one segment. ``tape=1`` is Griewank's classic schedule; a longer tape
    trades device memory for fewer backward calls, which is what a CPU (or any device where
    one autograd call costs about a step) needs. With ``n = ceil(T / tape)`` units the
    forward pass runs units ``0 .. n-2`` untaped and keeps the last unit taped, so a schedule
    costs exactly ``n + t(n, slots)`` unit evaluations (``t`` from
    `spikeckpt.plans.binomial.advances`), every one a full unit but the last. Device
    memory: ``min(slots + 1, n) * S + tape * A`` (the slots plus the working state, one taped
    unit; with ``slots >= n`` the start of the last unit is never stored, since it is only
    taped, and one unit, ``n = 1``, is plain BPTT). A tape longer than ``T`` is clamped.

    Args:
        slots: ``s >= 1``, device checkpoint slots.
        tape: ``>= 1``, steps per taped unit (default 1).

    Example:
        >>> Revolve(50).cost(1000).forward_steps
        2948
        >>> Revolve(50, tape=4).cost(1000).backprops
        250
    """

    def __init__(self, slots: int, tape: int = 1) -> None:
        self.slots = check_count("slots", slots)
        self.tape = check_count("tape", tape)

    def __repr__(self) -> str:
        if self.tape == 1:
            return f"Revolve(slots={self.slots})"
        return f"Revolve(slots={self.slots}, tape={self.tape})"

    def for_length(self, T: int) -> Revolve:
        check_length(T)
        if self.tape > T:
            return Revolve(self.slots, T)
        return self

    def schedule(self, T: int) -> Schedule:
        plan = self.for_length(T)
        return Schedule(T, revolve_parts(0, T, plan.slots, plan.tape), plan=repr(plan))

    def cost(
        self, T: int, *, state_bytes: int = 1, step_bytes: int = 1, costs: CostModel | None = None
    ) -> Cost:
        T = check_length(T)
        k = min(self.tape, T)
        n = -(-T // k)
        last = T - (n - 1) * k
        # the slots and the working state; a unit that is only taped is never stored, so
        # n units need at most n states (x_0 .. the start of unit n-2, and the working state)
        states = min(self.slots + 1, n)
        units = [(states, last)]
        if n >= 2:
            units.append((states, k))
        return make_cost(
            T,
            forward_steps=(n - 1 + advances(n, self.slots)) * k + last,
            backprops=n,
            peak_states=states,
            peak_taped=k,
            peak_units=tuple(units),
            remote=0,
            state_bytes=state_bytes,
            step_bytes=step_bytes,
            costs=costs,
        )
