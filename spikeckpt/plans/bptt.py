"""Plain backpropagation through time: tape every step."""

from __future__ import annotations

from spikeckpt.plans.base import Plan, check_length, make_cost
from spikeckpt.plans.schedule import Backprop, Schedule, Tape
from spikeckpt.plans.simulate import Cost, CostModel


class BPTT(Plan):
    """Tape all ``T`` steps in the forward pass. Device memory ``S + T*A``; ``T`` evaluations."""

    def schedule(self, T: int) -> Schedule:
        T = check_length(T)
        return Schedule(T, (Tape(0, T), Backprop(0, T)), plan=repr(self))

    def for_length(self, T: int) -> BPTT:
        check_length(T)
        return self

    def cost(
        self, T: int, *, state_bytes: int = 1, step_bytes: int = 1, costs: CostModel | None = None
    ) -> Cost:
        T = check_length(T)
        return make_cost(
            T,
            forward_steps=T,
            backprops=1,
            peak_states=1,
            peak_taped=T,
            peak_units=((1, T),),
            remote=0,
            state_bytes=state_bytes,
            step_bytes=step_bytes,
            costs=costs,
        )
