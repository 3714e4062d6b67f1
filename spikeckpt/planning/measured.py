"""What a budget planner measured for one input shape, and the roomier shape a re-plan plans
for.

A batch size planned before and planned again (batches of differing spike counts; data padded
per batch to its longest sample: tonic's ``PadTensors`` on SHD) is planned for a denser input
(`roomy`), and where that batch size met another length before, a longer one, where that plan
is about as fast: the batches after it reuse it instead of probing again. Measured on synthetic SHD (700-256-20, batch 32, ``dt_us=1000``, a 12 MiB
budget): 10 of the first 18 batches probed (0.4-0.7 s each, 71% of the run's time); now 2.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from spikeckpt.planning.choice import PlanChoice
from spikeckpt.planning.probe import Probe
from spikeckpt.plans import CostModel
from spikeckpt.plans.account import StepBytes, StepSizes
from spikeckpt.plans.layerwise import BlockSizes, MeasuredWorking

__all__ = [
    "ROOMY_DENSITY",
    "ROOMY_STEPS_PERCENT",
    "ROOMY_TOLERANCE",
    "Measured",
    "roomier",
    "roomy_length",
]

#: a re-plan plans for this many percent more steps than the call's (at least one more)
ROOMY_STEPS_PERCENT = 10

#: ... and for an input this many times as dense (its bytes scaled by both)
ROOMY_DENSITY = 1.2

#: the roomier plan is taken where its modeled time per step is at most this much above the
#: exact plan's
ROOMY_TOLERANCE = 0.05


class Measured(NamedTuple):
    """What a `BudgetPlanner` measured for one input shape, scaled to its batch."""

    T: int
    batch: int
    probe: Probe
    blocks: list[BlockSizes] | None
    working: MeasuredWorking | None
    seconds: tuple[float, float] | None
    on_device: bool
    costs: CostModel
    sizes: StepSizes
    note: str | None
    #: device bytes held while it plans (input, state, ``.grad`` held): the probes' room
    held: int = 0
    #: the parameters' ``.grad`` was held when the call began (accumulating gradients)
    grads_held: bool = False
    #: autocast's cached casts of the parameters (`cached_cast_bytes`), unseen by later probes
    casts: int = 0

    @property
    def remote_here(self) -> bool:
        """Whether a stack plan's remote checkpoints count in the device's memory: the device
        tier, the host of a CPU run, or a CPU step that draws (each checkpoint keeps the
        generator's state in memory)."""
        return self.on_device or self.probe.rng_bytes > 0

    @property
    def layer_base(self) -> StepBytes:
        """The layer-wise step beside its working set: input and outputs, ``.grad`` when the
        step counts it and it is held from before the call (the working set's running sums
        become ``.grad`` when it is None, and are added into one held: both held then), and
        autocast's cached casts of the weights, held beside the whole step as ``.grad``."""
        s, held = self.sizes, self.sizes.held_grads + self.casts
        return StepBytes(input=s.input, outputs=s.outputs(self.T), gradients=held)

    def roomy(self, longer: bool) -> Measured:
        """The same measurements for an input of `ROOMY_DENSITY` times the density and,
        ``longer``, `ROOMY_STEPS_PERCENT` more steps (at least one): what a plan must hold to
        serve the batches around this one (a plan for ``T'`` steps runs a call of up to
        `REUSE_SPAN` times fewer; one for an input of ``n`` bytes, any input up to ``n``)."""
        T = roomy_length(self.T) if longer else self.T
        nbytes = math.ceil(self.sizes.input * T / self.T * ROOMY_DENSITY)
        return self._replace(T=T, sizes=replace(self.sizes, input=nbytes))


def roomy_length(T: int) -> int:
    """The steps a re-plan for a call of ``T`` steps plans for: `ROOMY_STEPS_PERCENT` more,
    at least one more."""
    return T + max(1, -(-T * ROOMY_STEPS_PERCENT // 100))


def roomier(exact: PlanChoice, roomy: PlanChoice | None) -> PlanChoice:
    """``roomy`` where it was found and its modeled time per step is within `ROOMY_TOLERANCE`
    of ``exact``'s, else ``exact``."""
    if roomy is None:
        return exact
    per_step = exact.modeled.time / exact.T
    return roomy if roomy.modeled.time / roomy.T <= per_step * (1 + ROOMY_TOLERANCE) else exact
