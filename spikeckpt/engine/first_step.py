"""Step 0 run apart: initial states whose shape the first step sets.

snnTorch's ``init_leaky()`` gives empty tensors, Norse cells take ``None`` and build their own
state, Norse's ``initial_state(x).v`` is 0-d: the state has its real shape only after step 0.
`first_step` runs step 0 as the plain loop does (taped, so gradients reach the initial
state and everything step 0 used) and returns what it gave (`FirstStep`); ``scan`` then
runs steps ``1..T-1`` from its state and joins the outputs, bitwise those of the plain loop:
``readout=None`` prepends ``y_0``; ``"sum"``/``"mean"`` and a callable fold start their
accumulator at step 0 and carry it as state (`carried`), so the additions
happen in the loop's order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from spikeckpt.engine import tree as pytree
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.engine.readout import NARROW_FLOATS, Readout, take_extremum, widened
from spikeckpt.engine.rng import cuda_devices, generators_kept
from spikeckpt.engine.step import reachable, reachable_generators
from spikeckpt.errors import ConfigError, ConfigTypeError

__all__ = ["FirstStep", "changes_dtype", "first_step"]

Step = Callable[[Any, Any], tuple[Any, Any]]


@dataclass(frozen=True)
class FirstStep:
    """What step 0 gave.

    Attributes:
        state: the state after step 0, its ``None`` leaves left out (tensors only).
        y: step 0's output ``y_0``.
        step: the user's step on such states (puts the ``None`` leaves back around each call
            and checks they stay ``None``).
        rebuild: a state of ``step`` -> the user's structure (``None`` leaves put back).
    """

    state: Any
    y: Any
    step: Step
    rebuild: Callable[[Any], Any]

    def stacked(self, ys: Any) -> Any:
        """``ys`` of steps ``1..T-1`` (``(T-1, ...)``, or None for a single step) with ``y_0``
        in front: ``(T, ...)``."""
        if self.y is None:
            return None
        if ys is None:
            return pytree.tree_map(lambda y: y.unsqueeze(0), self.y)
        return pytree.tree_map(lambda a, b: torch.cat([a.unsqueeze(0), b]), self.y, ys)

    def carried(self, readout: Readout, device: torch.device) -> tuple[Step, Any]:
        """``(step, carry_0)`` for a reducing readout (``"sum"``, ``"mean"``, ``"max"``,
        ``"min"`` or a callable fold) carried as state from step 1 on: the carry is ``(state, acc)`` (a fold's:
        ``(state, acc, t)``, ``t`` a 0-d int64 tensor), its accumulator started at step 0."""
        step = self.step
        if callable(readout):
            fold = readout
            t0 = torch.ones((), dtype=torch.int64, device=device)

            def fold_step(carry: Any, x_t: Any) -> tuple[Any, None]:
                s, acc, t = carry
                s, y = step(s, x_t)
                return (s, fold(acc, y, int(t)), t + 1), None

            acc0 = fold(None, self.y, 0)
            acc_leaves = pytree.tree_flatten(acc0)[0]
            if not all(isinstance(a, Tensor) for a in acc_leaves):
                raise ConfigTypeError(  # as StepFn says it when step 0 runs in the run
                    "a callable readout must return a tensor or a pytree of tensors"
                )
            return fold_step, (self.state, acc0, t0)

        if readout in ("max", "min"):  # max(0)'s value and gradient (to the first of ties)
            kind = readout

            def extremum_step(carry: Any, x_t: Any) -> tuple[Any, None]:
                s, acc = carry
                s, y = step(s, x_t)
                better = pytree.tree_map(
                    lambda a, b: torch.where(take_extremum(kind, b, a), b, a), acc, y
                )
                return (s, better), None

            return extremum_step, (self.state, self.y)

        def sum_step(carry: Any, x_t: Any) -> tuple[Any, None]:
            s, acc = carry
            s, y = step(s, x_t)
            return (s, pytree.tree_map(lambda a, b: a + b, acc, y)), None

        # reduced-precision outputs are summed in float32, as torch's sum(0) sums them (the
        # run casts the sum back to the outputs' dtype: `narrowed`)
        return sum_step, (self.state, pytree.tree_map(widened, self.y))

    def narrowed(self, acc: Any) -> Any:
        """A sum `carried` in float32 back in the dtypes of the outputs it summed."""
        return pytree.tree_map(lambda a, y: a.to(y.dtype), acc, self.y)


def first_step(step: Step, state: Any, x0: Any) -> FirstStep:
    """Run ``step(state, x0)`` (taped when grad mode is on) and return what it gave."""
    state1, y0 = step(state, x0)
    if y0 is not None:  # as the checkpointed run checks every step's output (StepFn)
        leaves, y_def = pytree.tree_flatten(y0)
        for name, leaf in zip(y_def.names, leaves, strict=False):
            if not isinstance(leaf, Tensor):
                raise ConfigTypeError(f"step output y{name} is {type(leaf).__name__}, not a tensor")
    inner, state1, rebuild = _without_none_leaves(step, state1)
    return FirstStep(state1, y0, inner, rebuild)


def changes_dtype(step: Step, state: Any, x0: Any, params: Any = (), force: bool = False) -> bool:
    """Whether step 0 returns a state leaf in another dtype than the initial state's (a
    half-precision model whose step promotes its state to float32): scan then runs step 0
    apart and carries the dtypes it returns, as the plain loop does. Tried with one untaped
    step (RNG forked, the step's own generators kept, layers' side effects skipped) only
    where a dtype may change: a floating state leaf narrower than float32, or floating
    state, input, parameter and buffer leaves of more than one dtype, or ``force`` (autocast on: its
    ops change dtypes whatever the leaves'); False elsewhere (no step run)."""
    leaves = pytree.tree_flatten(state)[0]
    floats = [t for t in leaves if isinstance(t, Tensor) and t.is_floating_point()]
    if not floats:
        return False
    others = [
        t
        for t in (*pytree.tree_flatten(x0)[0], *params, *_buffers(step))
        if isinstance(t, Tensor) and t.is_floating_point()
    ]
    dtypes = {t.dtype for t in (*floats, *others)}
    # a step on a narrow float often computes something in float32 (snnTorch's spike
    # ``(mem - thr > 0).float()`` resets an fp16 membrane into float32)
    if not force and not any(t.dtype in NARROW_FLOATS for t in floats) and len(dtypes) < 2:
        return False
    with (
        torch.random.fork_rng(devices=cuda_devices([*floats, *others])),
        generators_kept(reachable_generators(step)),
        recompute_phase(),
        torch.no_grad(),
    ):
        new, _ = step(state, x0)
    after = pytree.tree_flatten(new)[0]
    if len(after) != len(leaves):
        return False  # another structure: the run's own check names it
    return any(
        isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype != b.dtype
        for a, b in zip(leaves, after, strict=True)
    )


def _buffers(step: Step) -> list[Tensor]:
    """The buffers of the modules ``step`` reaches: an option kept as a buffer (snnTorch's
    ``beta`` from NumPy, float64) promotes a float32 state at step 0 as a parameter would."""
    return [b for m in reachable(step)[1] for b in m.buffers(recurse=False)]


def _without_none_leaves(step: Step, state: Any) -> tuple[Step, Any, Callable[[Any], Any]]:
    """``(step', state', rebuild)``: when ``state`` (after step 0) holds ``None`` leaves that
    stay ``None`` (Norse's ``SequentialState`` returns ``None`` for its stateless layers),
    scan carries its tensor leaves only; ``step'`` puts the ``None`` back around each call
    (and checks they stay), ``rebuild`` restores the structure of a final state."""
    leaves, spec = pytree.tree_flatten(state)
    holes = [leaf is None for leaf in leaves]
    other = [leaf for leaf in leaves if leaf is not None and not isinstance(leaf, Tensor)]
    if other:
        raise ConfigTypeError(
            f"step 0 returned a state with a {type(other[0]).__name__} leaf; every state leaf "
            "after the first step must be a tensor (or None, kept as None)"
        )
    if not any(holes):
        return step, state, lambda s: s

    def fill(tensors: list[Tensor]) -> Any:
        it = iter(tensors)
        return pytree.tree_unflatten([None if h else next(it) for h in holes], spec)

    def strip(full: Any, t: str) -> list[Tensor]:
        got, got_spec = pytree.tree_flatten(full)
        if got_spec != spec or [leaf is None for leaf in got] != holes:
            raise ConfigError(
                f"step {t} returned a state with another structure (or other None leaves) than "
                "step 0's; the state structure must not change between steps"
            )
        return [leaf for leaf in got if leaf is not None]

    def stripped_step(tensors: list[Tensor], x_t: Any) -> tuple[list[Tensor], Any]:
        new, y = step(fill(tensors), x_t)
        return strip(new, ">0"), y

    return stripped_step, strip(state, "0"), fill
