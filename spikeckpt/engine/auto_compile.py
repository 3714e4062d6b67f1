"""``compile="auto"`` for the stack granularity's step: compile once eager calls have paid for it.

Compiling the model's step (`spikeckpt.engine.compiled_step`) costs seconds once per input
shape and then saves a share of every call: whether it pays depends on how many calls follow,
which no call can know. ``"auto"`` decides as a rent-or-buy rule does: each input shape runs
eagerly until its eager forward calls have taken `COMPILE_AFTER_SECONDS` (the backward pass
runs after the call returns, uncounted: a training step's total is 2-3x its forward, so about
what compiling a small model's step took on the development CPU: 3-12 s, less from inductor's
warm disk cache); then
the step is compiled, its first `WARMUP_CALLS` calls (which compile) are not timed, the next
`TRIAL_CALLS` are, and the compiled step is kept only where a training step took at most
`KEEP_RATIO` of the eager one's time per time step: the period from one call's start to the
next call's of the same shape (forward, backward, the optimizer: the compiled backward is
where most of the gain is), the minimum over calls; where no two calls of a shape ran back
to back, the forward calls' times (each less its planning). So a shape never run long costs nothing, and one run long spends at most about
twice the best choice's compile time. Measured (one thread, 200-256-10 snnTorch ``Leaky``,
batch 16, T = 300): the compiled step took 0.67-0.74x the eager time after 11.6 s of
compiling (3.2 s for a second model of the same shape).

A model with forward hooks stays eager (hooks installed around each call would recompile the
step at each call); without a compiler the step stays eager with one line, said when the
step would compile. Under a ``TorchDispatchMode`` (``MemoryMeter``, the planner's probes) a
call is neither timed nor compiled.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from spikeckpt.engine.compiled import under_dispatch_mode
from spikeckpt.engine.compiled_step import CompiledStep, compiled_step

__all__ = [
    "COMPILE_AFTER_SECONDS",
    "KEEP_RATIO",
    "TRIAL_CALLS",
    "WARMUP_CALLS",
    "AutoCompiledStep",
    "InputKey",
    "input_key",
]

#: eager seconds (forward calls of one input shape, planning left out) before "auto" compiles
COMPILE_AFTER_SECONDS = 5.0
#: compiled calls not timed: dynamo compiles during the first two (the first call's later
#: steps, then the second call's first step, whose state has a gradient by then)
WARMUP_CALLS = 2
#: compiled calls timed against the eager ones before the choice is final
TRIAL_CALLS = 2
#: the compiled step is kept where its time per step is at most this share of the eager one's
KEEP_RATIO = 0.95


@dataclass
class _Shape:
    """What one input shape's calls measured (seconds per time step, minimum over calls)."""

    eager_seconds: float = 0.0
    eager_per_step: float = math.inf
    #: the last `TRIAL_CALLS` eager periods: the compiled trial's few are weighed against as
    #: many (the least of ~65 eager periods against the least of 2 compiled ones kept eager
    #: on a noisy machine where compiled steps took 0.83x eager's time)
    eager_recent: list[float] = field(default_factory=list)
    compiled_calls: int = 0
    compiled_per_step: float = math.inf
    compiled_period: float = math.inf
    trial_periods: int = 0
    compiled: bool | None = None  # the final choice; None while eager time accrues or on trial

    def choose(self) -> None:
        """Keep the compiled step or not, by the training steps' periods (forward, backward
        and whatever the loop does between two calls: the same for both), or by the forward
        calls' times where no period was measured (calls of this shape not back to back)."""
        if self.eager_recent and math.isfinite(self.compiled_period):
            self.compiled = self.compiled_period <= KEEP_RATIO * min(self.eager_recent)
        else:
            self.compiled = self.compiled_per_step <= KEEP_RATIO * self.eager_per_step


class AutoCompiledStep:
    """Chooses per input shape between ``step`` and its compiled copy (see the module
    docstring); `step_for` before a call, `ran` after it.

    Attributes:
        shapes: what each input shape's calls measured, by the key `step_for` was given.
    """

    def __init__(self, step: Callable[[Any, Any], Any], device: torch.device) -> None:
        self.step = step
        self.device = device
        self.shapes: dict[InputKey, _Shape] = {}
        self._compiled: CompiledStep | None = None
        self._no_compiler = False
        #: the last call: its key, its start (seconds) and what its period counts for
        self._open: tuple[InputKey, float, str] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        """Copies hold None, as `CompiledStep`'s do: a copy's model decides again."""
        return (_nothing, ())

    def step_for(self, key: InputKey, model: nn.Module) -> Callable[[Any, Any], Any]:
        """The step a call with input key ``key`` runs: eager, or the `CompiledStep`."""
        now = time.perf_counter()
        self._close_period(key, now)
        shape = self.shapes.setdefault(key, _Shape())
        if shape.compiled is None and shape.trial_periods >= TRIAL_CALLS:
            shape.choose()
        self._open = (key, now, "eager")
        if shape.compiled is False or _hooked(model) or under_dispatch_mode():
            return self.step
        trying = shape.compiled is None and shape.compiled_calls > 0
        if not shape.compiled and not trying and shape.eager_seconds < COMPILE_AFTER_SECONDS:
            return self.step
        compiled = self._compiled_step()
        if compiled is None or compiled.failed:
            shape.compiled = False
            return self.step
        trial = shape.compiled is None and shape.compiled_calls >= WARMUP_CALLS
        self._open = (key, now, "trial" if trial else "")
        return compiled

    def _close_period(self, key: InputKey, now: float) -> None:
        """The time since the last call's start, per time step, is that call's period where
        this call has its shape (back to back, as a training loop's steps)."""
        if self._open is None or self._open[0] != key:
            return
        _, started, kind = self._open
        shape = self.shapes[key]
        period = (now - started) / max(key.shape[0], 1)
        if kind == "eager":
            shape.eager_recent = [*shape.eager_recent, period][-TRIAL_CALLS:]
        elif kind == "trial":
            shape.compiled_period = min(shape.compiled_period, period)
            shape.trial_periods += 1

    def ran(self, key: InputKey, step: Callable[..., Any], seconds: float) -> None:
        """Count a call whose forward took ``seconds`` (planning left out)."""
        shape = self.shapes.get(key)
        if shape is None or under_dispatch_mode():
            self._open = None
            return
        per_step = seconds / max(key.shape[0], 1)
        if not isinstance(step, CompiledStep):
            shape.eager_seconds += seconds
            shape.eager_per_step = min(shape.eager_per_step, per_step)
            return
        if not step.ran_compiled:
            shape.compiled = False if step.failed else shape.compiled
            self._open = None
            return
        shape.compiled_calls += 1
        if shape.compiled is None and shape.compiled_calls > WARMUP_CALLS:
            shape.compiled_per_step = min(shape.compiled_per_step, per_step)

    def _compiled_step(self) -> CompiledStep | None:
        if self._compiled is None and not self._no_compiler:
            self._compiled = compiled_step(self.step, self.device)  # None: one line, eager
            self._no_compiler = self._compiled is None
        return self._compiled


class InputKey(NamedTuple):
    """What a call's compiled step depends on (what dynamo's guards recompile on)."""

    shape: tuple[int, ...]
    dtype: Any
    device: str
    grad: bool


def input_key(x: Any) -> InputKey:
    """The key of a call's input ``x`` ``(T, B, ...)`` (a tensor or a packed train)."""
    return InputKey(
        tuple(x.shape),
        getattr(x, "dtype", None),
        str(getattr(x, "device", "")),
        torch.is_grad_enabled(),
    )


def _hooked(model: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _nothing() -> None:
    return None
