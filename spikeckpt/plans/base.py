"""The `Plan` interface and argument checks shared by every plan. Pure Python."""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from typing import Any, Literal, overload

from spikeckpt.errors import ConfigError
from spikeckpt.plans.schedule import Schedule
from spikeckpt.plans.simulate import Cost, CostModel, simulate


def check_length(T: Any) -> int:
    """Return ``T`` if it is a whole number of steps >= 1, else raise a clear ValueError."""
    if isinstance(T, bool) or not isinstance(T, int):
        raise ConfigError(f"the sequence length T must be an int >= 1, got {T!r}")
    if T < 1:
        raise ConfigError(f"the sequence length T must be >= 1 step, got T={T}")
    return T


@overload
def check_count(name: str, value: Any, *, allow_none: Literal[False] = False) -> int: ...


@overload
def check_count(name: str, value: Any, *, allow_none: bool) -> int | None: ...


def check_count(name: str, value: Any, *, allow_none: bool = False) -> int | None:
    """Return ``value`` if it is an int >= 1 (or None when allowed), else raise ValueError."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")
    return value


class Plan(ABC):
    """A checkpointing strategy: turns a sequence length ``T`` into a [`Schedule`][spikeckpt.plans.schedule.Schedule].

    Subclasses implement `schedule` and `for_length`; they may override
    `cost` with a closed form (tests check it against [`simulate`][spikeckpt.plans.simulate.simulate]).

    One validation rule: a plan's own arguments are checked when it is built (a
    contradiction such as a local interval longer than an explicit remote one raises
    ValueError); whatever depends on ``T`` (an interval or tape longer than the sequence) is
    clamped to ``T`` the same way by `schedule`, `cost` and `for_length`.
    """

    #: True when the plan stores states in the remote (host/disk) tier.
    uses_remote: bool = False

    @abstractmethod
    def schedule(self, T: int) -> Schedule:
        """The schedule for ``T`` steps (ValueError on a bad ``T``; intervals clamped to ``T``)."""

    @abstractmethod
    def for_length(self, T: int) -> Plan:
        """A copy with every default filled in for ``T`` steps and intervals clamped to ``T``."""

    def as_run(self, T: int) -> Plan:
        """The plan that runs on ``T`` steps, named for what it is: `for_length`, except
        where another family's plan has the very same schedule (a ``Double`` whose remote
        interval covers ``T`` keeps no remote checkpoint: it is ``Uniform(local_interval)``).
        """
        return self.for_length(T)

    def cost(
        self,
        T: int,
        *,
        state_bytes: int = 1,
        step_bytes: int = 1,
        costs: CostModel | None = None,
    ) -> Cost:
        """Counts, peak bytes and modeled time of this plan on ``T`` steps.

        Args:
            T: steps.
            state_bytes: ``S``, bytes of one state.
            step_bytes: ``A``, bytes saved by autograd for one taped step.
            costs: operation times (default [`CostModel`][spikeckpt.plans.simulate.CostModel]).
        """
        return simulate(
            self.for_length(T).schedule(T),
            state_bytes=state_bytes,
            step_bytes=step_bytes,
            costs=costs,
        )

    def __repr__(self) -> str:
        """The notation every command, table, example and log uses for a plan.

        ``Name(argument=value, ...)`` with every constructor argument whose value is not its
        default (``Uniform(interval=200)``, ``Double(remote_interval=64, local_interval=8)``,
        ``TwoLevel(slots=8, write_cost=2.5, read_cost=1.5)``, ``Uniform()``): whole, and
        building it again gives an equal plan.
        """
        defaults = _defaults(type(self))
        fields = ", ".join(
            f"{k}={v!r}"
            for k, v in vars(self).items()
            if not k.startswith("_") and not (k in defaults and defaults[k] == v)
        )
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(vars(self).items()))))


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    """Constructor argument -> default value, for the arguments that have one."""
    parameters = inspect.signature(cls).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def make_cost(
    T: int,
    *,
    forward_steps: int,
    backprops: int,
    peak_states: int,
    peak_taped: int,
    peak_units: tuple[tuple[int, int], ...],
    remote: int,
    state_bytes: int,
    step_bytes: int,
    costs: CostModel | None,
) -> Cost:
    """Assemble a closed-form [`Cost`][spikeckpt.plans.simulate.Cost].

    ``peak_units`` lists the (states, taped) pairs that can be the peak moment; the peak bytes
    is the largest ``states * S + taped * A`` among them. ``remote`` is the number of remote
    writes, equal to the number of remote reads and to the peak remote states. ``backprops``
    is the number of taped segments (``Backprop`` actions).
    """
    costs = costs or CostModel()
    peak_bytes = max(states * state_bytes + taped * step_bytes for states, taped in peak_units)
    time = (
        forward_steps * costs.forward
        + T * costs.backward
        + remote * (costs.write + costs.read)
        + backprops * costs.segment
    )
    return Cost(
        T=T,
        forward_steps=forward_steps,
        backward_steps=T,
        peak_device_states=peak_states,
        peak_taped_steps=peak_taped,
        remote_writes=remote,
        remote_reads=remote,
        peak_remote_states=remote,
        peak_bytes=peak_bytes,
        time=time,
        state_bytes=state_bytes,
        step_bytes=step_bytes,
        backprops=backprops,
    )


def geometric_grid(limit: int, points: int = 48) -> list[int]:
    """About ``points`` integers from 1 to ``limit``, geometrically spaced, plus the ends (the
    one grid the planners search intervals and tape lengths on)."""
    values = {1, limit}
    for i in range(points + 1):
        values.add(max(1, min(limit, round(limit ** (i / points)))))
    return sorted(values)
