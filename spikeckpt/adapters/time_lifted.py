"""Stateless layers written for whole sequences: the plain layers of a Norse
``SequentialState`` that holds sequence modules (``LIF``, ``LI``, ``Lift``).

Norse's call hands such a layer the whole sequence ``(T, B, ...)``; spikeckpt runs it one step
at a time, on ``x_t[None]`` (a sequence of one step), and takes the step back out. That is the
same computation only where the layer treats each time step alone (``nn.Flatten(2)``, a
``Linear``, ``x.flatten(2)`` in a module of yours). A layer that mixes time steps (a max over
time, ``z[1:] - z[:-1]``, a ``BatchNorm1d`` on ``(T, B, C)``, whose statistics span time, a
``Flatten(0, 1)``) would run otherwise: each layer is checked once per input shape on a
probe of two random steps (its output on both at once against its outputs on each alone),
and one that mixes them is refused, naming it. A layer of yours that draws random numbers is
refused the same way (a sequence's draws are not its steps' draws); torch's Dropout, which
draws per element, is not probed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from spikeckpt.adapters.generic import StatelessAdapter
from spikeckpt.adapters.protocol import LayerAdapter, State, unsupported
from spikeckpt.engine.phase import RUNNING_STATS_TYPES, frozen_running_stats

__all__ = ["TimeLiftedAdapter", "mixes_time"]


class TimeLiftedAdapter(LayerAdapter):
    """A stateless layer written for whole sequences ``(T, B, ...)`` (inside a Norse
    ``SequentialState`` with sequence modules): ``y_t = module(x_t[None])[0]``, refused
    where the layer mixes time steps (`mixes_time`)."""

    stateful = False

    def __init__(self, inner: StatelessAdapter) -> None:
        super().__init__(inner.module, inner.path)
        self.inner = inner
        self._checked: set[tuple[Any, ...]] = set()

    def init_state(self, x_t: Tensor) -> State:
        return ()

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        self.check_time_local(x_t)
        _, y = self.inner.step((), x_t.unsqueeze(0))
        return (), y[0]

    def check(self) -> None:
        self.inner.check()

    def check_time_local(self, x_t: Tensor) -> None:
        """Refuse the layer where it mixes time steps of ``x_t``'s shape (once per shape)."""
        key = (tuple(x_t.shape), x_t.dtype, x_t.device, self.module.training)
        if key in self._checked or isinstance(self.module, nn.modules.dropout._DropoutNd):
            return
        problem = mixes_time(self.inner, x_t)
        if problem is not None:
            raise unsupported(
                self.module,
                self.path,
                "in a SequentialState of sequence modules (LIF, LI, Lift) Norse's call hands "
                f"this layer the whole sequence (T, B, ...), and it does not treat each time "
                f"step alone ({problem}: it mixes time steps, or draws random numbers); "
                "spikeckpt runs the sequence one step at a time. Apply it to the wrapped "
                "model's output instead (a max over time: `seq(x)[0].max(0).values`, or "
                'wrap(..., readout="max")); a layer meant for each step alone (a Conv2d '
                "between Flatten(0, 1) and Unflatten) goes in norse.torch.Lift(layer); or "
                "build the model of Norse cells (LIFCell, LICell), run step by step",
            )
        self._checked.add(key)


def mixes_time(layer: StatelessAdapter, x_t: Tensor) -> str | None:
    """How ``layer`` applied to two steps at once differs from it applied to each alone, on
    random steps shaped like ``x_t`` ``(B, ...)``; None where it does not. Nothing is recorded
    for autograd, no running statistic moves, torch's generator is left as it was."""
    generator = torch.Generator(device=x_t.device).manual_seed(0)
    shape = (2, *x_t.shape)
    if x_t.is_floating_point():
        z = torch.rand(shape, generator=generator, device=x_t.device, dtype=x_t.dtype)
    else:
        z = torch.randint(0, 2, shape, generator=generator, device=x_t.device).to(x_t.dtype)
    with (
        torch.no_grad(),
        torch.random.fork_rng(devices=[]),
        frozen_running_stats(
            [m for m in layer.module.modules() if isinstance(m, RUNNING_STATS_TYPES)]
        ),
    ):
        both = layer.step((), z)[1]
        each = [layer.step((), z[i : i + 1])[1] for i in range(2)]
    if not isinstance(both, Tensor) or any(not isinstance(y, Tensor) for y in each):
        return None  # not a tensor: the step's own call says what it makes of it
    if any(y.shape[:1] != (1,) for y in each) or both.shape != (2, *each[0].shape[1:]):
        alone = ", ".join(str(tuple(y.shape)) for y in each)
        return f"two steps {tuple(shape)} gave {tuple(both.shape)}, one step each {alone}"
    apart = torch.cat(each)
    if both.is_floating_point():
        scale = float(apart.abs().max()) if apart.numel() else 0.0
        same = torch.allclose(both, apart, rtol=1e-5, atol=1e-6 * max(scale, 1.0))
    else:
        same = torch.equal(both, apart)
    return None if same else "its output on two steps at once differs from its output on each"
