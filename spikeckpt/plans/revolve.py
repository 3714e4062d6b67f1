"""Optimal binomial checkpointing (Griewank & Walther's Revolve) with ``slots`` device slots."""

from __future__ import annotations

from spikeckpt.plans.base import Plan, check_count, check_length, make_cost
from spikeckpt.plans.binomial import advances
from spikeckpt.plans.builders import reverse
from spikeckpt.plans.schedule import Action, Free, Schedule, Store
from spikeckpt.plans.simulate import Cost, CostModel


class Revolve(Plan):
    """Binomial checkpointing: the fewest evaluations for a given number of device slots.

    ``x_0`` takes one of the ``slots``. The forward pass runs steps ``0 .. T-2`` untaped and
    keeps the last step taped, so a schedule costs exactly ``T + t(T, slots)`` step
    evaluations (``t`` from :func:`spikeckpt.plans.binomial.advances`). Device memory:
    ``(min(slots, T) + 1) * S + A`` (the slots plus the working state, one taped step).

    Args:
        slots: ``s >= 1``, device checkpoint slots.
    """

    def __init__(self, slots: int) -> None:
        self.slots = check_count("slots", slots)

    def for_length(self, T: int) -> Revolve:
        check_length(T)
        return self

    def schedule(self, T: int) -> Schedule:
        T = check_length(T)
        actions: list[Action] = [Store(0, "device")]
        reverse(0, T, self.slots, actions)
        actions.append(Free(0, "device"))
        return Schedule(T, tuple(actions), plan=repr(self))

    def cost(
        self, T: int, *, state_bytes: int = 1, step_bytes: int = 1, costs: CostModel | None = None
    ) -> Cost:
        T = check_length(T)
        states = min(self.slots, T) + 1
        return make_cost(
            T,
            forward_steps=T + advances(T, self.slots),
            peak_states=states,
            peak_taped=1,
            peak_units=((states, 1),),
            remote=0,
            state_bytes=state_bytes,
            step_bytes=step_bytes,
            costs=costs,
        )
