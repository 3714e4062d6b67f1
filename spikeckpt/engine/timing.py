"""Measured operation times of one step, for plans that leave their intervals to the engine.

[`spikeckpt.scan`][spikeckpt.engine.scan.scan] runs ``plan="auto"`` and plans built without intervals (``Double()``,
``Uniform()``, ``TwoLevel(s)``; `spikeckpt.plans.intervals.fill`) with intervals chosen
from the state and tape sizes and from these times: one untaped step, backpropagating one
taped step, the fixed cost of one backward call, and one state's write to and read from the
storage tier. `measure_costs` takes a few dozen step evaluations (``steps`` steps a few
times, taped and untaped); [`spikeckpt.scan`][spikeckpt.engine.scan.scan] caches the plan it fills per step function,
shapes, ``T`` and tier, so a training loop measures once.

Measuring changes nothing: the RNG is forked, gradients go to fresh tensors (no ``.grad`` is
touched), and the steps run inside `recompute_phase`, so layers
with side effects (BatchNorm's running statistics) skip them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from spikeckpt.engine.packed import step_of
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.engine.rng import cuda_devices
from spikeckpt.engine.tree import TreeDef, is_float
from spikeckpt.plans.simulate import CostModel
from spikeckpt.storage.base import Ledger
from spikeckpt.storage.tiers import make_store

__all__ = ["MEASURED_STEPS", "measure_costs"]

#: steps of the sequence the measurement runs (at most ``T``)
MEASURED_STEPS = 8

Step = Callable[[Any, Any], tuple[Any, Any]]


def _best(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_costs(
    step: Step,
    state_def: TreeDef,
    leaves: Sequence[Tensor],
    in_def: TreeDef,
    inputs: Sequence[Tensor],
    params: Sequence[Tensor],
    *,
    storage: str,
    device: torch.device,
    directory: str | os.PathLike[str] | None = None,
    steps: int = MEASURED_STEPS,
    repeats: int = 3,
) -> CostModel:
    """Seconds per operation of ``step`` on the first ``steps`` inputs (best of ``repeats``).

    Args:
        step: the user's ``step(state, x_t) -> (state, y_t)``.
        state_def, leaves: the initial state as a `TreeDef` and its leaves.
        in_def, inputs: the per-step input structure and the time-first input leaves.
        params: tensors requiring grad that the step uses.
        storage: the tier whose write and read are timed (``"device"``: none).
        device: the compute device.
        directory: the disk tier's parent folder.

    Returns:
        A [`CostModel`][spikeckpt.plans.simulate.CostModel] in seconds: ``forward`` (one untaped step),
        ``backward`` (one taped step's forward and backward, minus ``forward``), ``segment``
        (one backward call beyond its steps), ``write`` and ``read`` (one state).
    """
    n = max(1, min(steps, int(inputs[0].shape[0]) if inputs else 1))
    xs = [
        in_def.unflatten([step_of(leaf, t, device) for leaf in inputs]) if inputs else None
        for t in range(n)
    ]
    wrt_params = [p for p in params if p.requires_grad]

    def run(a: int, b: int, current: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        state, outs = state_def.unflatten(current), []
        for t in range(a, b):
            state, y = step(state, xs[t])
            outs += [v for v in _leaves(y) if v.requires_grad]
        last = state_def.flatten(state) or []
        return last, outs

    def untaped() -> None:
        with torch.no_grad():
            run(0, n, list(leaves))
        _sync(device)

    def taped(calls: int) -> None:
        # n steps backpropagated in `calls` autograd calls, parameter gradients summed
        size = -(-n // calls)
        current = list(leaves)
        for a in range(0, n, size):
            b = min(n, a + size)
            first = [t.detach().requires_grad_(is_float(t)) for t in current]
            with torch.enable_grad():
                last, outs = run(a, b, first)
                outs += [v for v in last if v.requires_grad]
                wrt = [v for v in first if v.requires_grad] + wrt_params
                if outs and wrt:
                    torch.autograd.grad(
                        outs, wrt, [torch.ones_like(v) for v in outs], allow_unused=True
                    )
            current = [t.detach() for t in last]
        _sync(device)

    with (
        torch.random.fork_rng(devices=cuda_devices([*leaves, *inputs])),
        recompute_phase(),
    ):
        untaped()
        taped(1)  # warm-up
        forward = _best(untaped, repeats) / n
        joint = _best(lambda: taped(1), repeats)
        segment = 0.0
        if n > 1:
            single = _best(lambda: taped(n), repeats)
            segment = max(0.0, (single - joint) / (n - 1))
    backward = max(joint / n - forward, 1e-9)
    write, read = _copy_seconds(leaves, storage, device, directory)
    return CostModel(
        forward=max(forward, 1e-9), backward=backward, write=write, read=read, segment=segment
    )


def _leaves(y: Any) -> list[Tensor]:
    if isinstance(y, Tensor):
        return [y]
    from torch.utils import _pytree as pytree

    return [v for v in pytree.tree_leaves(y) if isinstance(v, Tensor)]


def _copy_seconds(
    leaves: Sequence[Tensor],
    storage: str,
    device: torch.device,
    directory: str | os.PathLike[str] | None,
) -> tuple[float, float]:
    """One state written to the tier and read back (best of 3), halved; 0 on the device."""
    if storage == "device":
        return 0.0, 0.0
    store = make_store(storage, device, Ledger(), directory)
    try:
        tensors = [t.detach() for t in leaves]
        best = float("inf")
        for key in range(3):
            start = time.perf_counter()
            store.put(key, tensors)
            store.prefetch(key)
            store.get(key)
            _sync(device)
            best = min(best, time.perf_counter() - start)
            store.drop(key)
    finally:
        store.close()
    return best / 2, best / 2
