"""Readouts: the outputs a run builds from the per-step outputs ``y_t``, and their gradients.

One `Reducer` serves both granularities: the schedule executor emits one step at a time
(`Reducer.emit`), the layer-wise job one chunk of steps at a time
(`Reducer.emit_chunk`); sums run in time order either way, so both give the values of a
plain loop that adds each step to a running total bitwise (``torch.stack(ys).sum(0)`` orders
its float32 sum otherwise: round-off apart). Reduced-precision outputs (``bfloat16`` / ``float16``, under autocast)
are summed in ``float32`` and rounded once at the end, as ``torch.stack(ys).sum(0)`` sums
them: a running sum in ``bfloat16`` stops growing once the step's value is below half its
spacing (a Norse ``LICell``'s voltage summed over 600 steps: 8192 against 14272). In the
backward pass `Reducer.y_grad` gives ``dL/dy_t`` per step and `Reducer.chunk_grad` per chunk.

``"max"`` / ``"min"`` are ``ys.max(0).values`` / ``ys.min(0).values`` of the stacked outputs,
with their gradient: torch sends it to one index per element, the first of tied extrema (the
first NaN when there is one), and so does the reducer (it keeps that index, ``(B, ...)``
int64 per output, until backward). A fold ``torch.maximum(acc, y_t)`` would split the gradient
between ties instead: `take_extremum` is the fold that agrees with ``max(0)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Union

import torch
from torch import Tensor

from spikeckpt.engine.ordered_sum import add_steps_in_order
from spikeckpt.errors import ConfigError

__all__ = [
    "NARROW_FLOATS",
    "READOUTS",
    "Readout",
    "ReadoutFn",
    "Reducer",
    "YGrad",
    "check_readout",
    "take_extremum",
    "widened",
]

ReadoutFn = Callable[[Any, Any, int], Any]
Readout = Union[None, Literal["sum", "mean", "last", "max", "min"], ReadoutFn]  # noqa: UP007
YGrad = Callable[[int], Sequence[Tensor | None]]

#: the named readouts (a callable ``fold(acc, y_t, t) -> acc`` is the other kind)
READOUTS: tuple[str | None, ...] = (None, "sum", "mean", "last", "max", "min")
_EXTREMA = ("max", "min")
#: floating dtypes narrower than float32: their sums over time run in float32 (as torch's own
#: reductions run them)
NARROW_FLOATS = (torch.float16, torch.bfloat16)


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a running sum of ``dtype`` outputs is kept in: float32 for the
    reduced-precision floats (`NARROW_FLOATS`), else ``dtype``."""
    return torch.float32 if dtype in NARROW_FLOATS else dtype


def widened(y: Tensor) -> Tensor:
    """``y`` in float32 when it is a reduced-precision float (`NARROW_FLOATS`), else itself:
    a sum's running value."""
    return y.to(_sum_dtype(y.dtype))


def _taped(outs: Sequence[Tensor]) -> bool:
    """Whether autograd records the chunk's sums (an output needs a gradient)."""
    return torch.is_grad_enabled() and any(o.requires_grad for o in outs)


def check_readout(readout: Any) -> None:
    """Raise ``ValueError`` unless ``readout`` is a named readout or a callable."""
    if not (readout in READOUTS or callable(readout)):
        raise ConfigError(
            "readout must be None, 'sum', 'mean', 'last', 'max', 'min' or a callable "
            f"fold(acc, y_t, t), got {readout!r}"
        )


def take_extremum(kind: str, new: Tensor, acc: Tensor) -> Tensor:
    """Where ``new`` (a later step's value) replaces ``acc`` (the running extremum) in
    ``ys.max(0)`` (``kind="max"``) or ``ys.min(0)``: where it is strictly larger (smaller), or
    NaN while ``acc`` is not; ties keep ``acc``, the earlier index, as torch does.

    ``torch.where(take_extremum("max", y, acc), y, acc)`` is the running maximum with the
    gradient of ``max(0)`` (to one index per element), unlike ``torch.maximum(acc, y)``.
    """
    beaten = new > acc if kind == "max" else new < acc
    if not new.is_floating_point() and not new.is_complex():
        return beaten
    return beaten | (new.isnan() & ~acc.isnan())


class Reducer:
    """Builds the outputs from ``y_t`` in the forward pass; gives ``dL/dy_t`` in backward.

    ``None``: stacked ``(T, ...)`` per output leaf. ``"sum"``: ``y_0 + y_1 + ...`` in time order.
    ``"mean"``: that sum divided by ``T``. ``"last"``: ``y_{T-1}``. ``"max"`` / ``"min"``: the
    extremum over time, with the index that gets the gradient (see `take_extremum`).
    """

    def __init__(self, kind: str | None, T: int) -> None:
        self.kind = kind
        self.T = T
        self.acc: list[Tensor] | None = None
        #: ``"sum"`` / ``"mean"``: each output leaf's dtype (the sums of reduced-precision
        #: leaves run in float32)
        self.dtypes: list[torch.dtype] = []
        #: ``"max"`` / ``"min"``: per output leaf, the step ``(B, ...)`` int64 whose value the
        #: extremum is (kept after `outputs` for the backward pass)
        self.index: list[Tensor] = []
        #: ``"sum"`` / ``"mean"``: whether ``acc`` holds this reducer's own tensors (made by
        #: `emit_chunk`, added into in place), not a step's output (`emit`'s first step)
        self.owned = False

    def emit(self, t: int, ys: Sequence[Tensor]) -> None:
        """Take the outputs ``ys`` (each ``(B, ...)``) of step ``t``."""
        kind, T = self.kind, self.T
        if kind is None:
            if self.acc is None:
                self.acc = [y.new_empty((T, *y.shape)) for y in ys]
            for buf, y in zip(self.acc, ys, strict=True):
                buf[t].copy_(y)
        elif kind in ("sum", "mean"):
            if self.acc is None:
                self.dtypes = [y.dtype for y in ys]
                self.acc = [widened(y) for y in ys]
            else:
                self.acc = [a + y for a, y in zip(self.acc, ys, strict=True)]
        elif kind in _EXTREMA:
            if self.acc is None:  # copies: ys may be a tape's tensors, and acc changes in place
                self.acc = [y.clone() for y in ys]
                self.index = [
                    torch.full(y.shape, t, dtype=torch.int64, device=y.device) for y in ys
                ]
                return
            for acc, index, y in zip(self.acc, self.index, ys, strict=True):
                take = take_extremum(kind, y, acc)
                torch.where(take, y, acc, out=acc)
                index.masked_fill_(take, t)
        elif t == T - 1:
            self.acc = list(ys)

    def _extremum(self, t0: int, outs: Sequence[Tensor]) -> None:
        """Fold the outputs of steps ``t0 ..`` (each ``(k, B, ...)``) into the running extremum
        and its index: ``max(0)`` / ``min(0)`` over the chunk first (the first index of tied
        values), then the chunk against the earlier steps (ties keep the earlier step)."""
        kind = self.kind
        assert kind is not None
        found = [o.max(0) if kind == "max" else o.min(0) for o in outs]
        if self.acc is None:
            self.acc = [value for value, _ in found]
            self.index = [at.add_(t0) if t0 else at for _, at in found]
            return
        for acc, index, (value, at) in zip(self.acc, self.index, found, strict=True):
            take = take_extremum(kind, value, acc)
            torch.where(take, value, acc, out=acc)
            torch.where(take, at + t0, index, out=index)

    def emit_chunk(self, t0: int, outs: Sequence[Tensor]) -> None:
        """Take the outputs of steps ``t0 .. t0 + k - 1`` at once (each ``(k, B, ...)``)."""
        if self.kind is None:
            if self.acc is None:
                self.acc = [o.new_empty((self.T, *o.shape[1:])) for o in outs]
            for buf, o in zip(self.acc, outs, strict=True):
                buf[t0 : t0 + o.shape[0]].copy_(o)
            return
        if self.kind in _EXTREMA:
            self._extremum(t0, outs)
            return
        if self.kind == "last":
            # a copy of the last row: ``unbind``'s views kept the whole (k, B, ...) chunk alive,
            # and autograd refuses an in-place op on them (``out -= out.max(...)``), which the
            # plain loop's ``torch.stack(...)[-1]`` allows
            if outs and t0 + outs[0].shape[0] == self.T:
                self.acc = [o[-1].clone() for o in outs]
            return
        if self.kind in ("sum", "mean") and self._summed_in_place(outs):
            return
        steps = [o.unbind(0) for o in outs]
        for i, ys in enumerate(zip(*steps, strict=True)):
            self.emit(t0 + i, ys)

    def _summed_in_place(self, outs: Sequence[Tensor]) -> bool:
        """Add the chunks ``outs`` (each ``(k, B, ...)``) to the running sums in place, in
        time order (`add_steps_in_order`); False, adding nothing, where the sums are not this
        reducer's own tensors (begun by `emit`) or autograd records them."""
        fresh = self.acc is None
        if not (fresh or self.owned) or _taped(outs):
            return False
        if fresh:  # the first step, copied: the running sums are added into in place
            self.dtypes = [o.dtype for o in outs]
            self.acc = [o[0].to(_sum_dtype(o.dtype), copy=True) for o in outs]
            self.owned = True
            outs = [o[1:] for o in outs]
        assert self.acc is not None
        for acc, o in zip(self.acc, outs, strict=True):
            add_steps_in_order(acc, o)
        return True

    def outputs(self) -> list[Tensor]:
        """The readout's outputs (and forget them)."""
        acc, self.acc, self.owned = self.acc or [], None, False
        if self.kind == "mean":
            acc = [a / self.T for a in acc]
        if self.kind in ("sum", "mean"):
            acc = [a.to(d) for a, d in zip(acc, self.dtypes, strict=True)]
        return acc

    def y_grad(self, grads: Sequence[Tensor | None]) -> YGrad:
        """``t -> dL/dy_t`` (one entry per output leaf) from the outputs' gradients."""
        kind, T = self.kind, self.T
        none = [None] * len(grads)
        if all(g is None for g in grads):
            return lambda t: none
        if kind is None:
            return lambda t: [None if g is None else g[t] for g in grads]
        if kind == "sum":
            return lambda t: grads
        if kind == "mean":
            scaled = [None if g is None else g / T for g in grads]
            return lambda t: scaled
        if kind in _EXTREMA:
            index = self.index
            return lambda t: [
                None if g is None else torch.where(i == t, g, 0)
                for g, i in zip(grads, index, strict=True)
            ]
        return lambda t: grads if t == T - 1 else none

    def chunk_grad(self, grads: Sequence[Tensor | None], t0: int, t1: int) -> list[Tensor | None]:
        """``dL/dy`` for steps ``t0 .. t1 - 1`` at once, each ``(t1 - t0, B, ...)`` or None."""
        kind, k = self.kind, t1 - t0
        res: list[Tensor | None] = []
        for g in grads:
            if g is None:
                res.append(None)
            elif kind is None:
                res.append(g[t0:t1])
            elif kind in ("sum", "mean"):
                g = g / self.T if kind == "mean" else g
                res.append(g.unsqueeze(0).expand(k, *g.shape))
            elif kind in _EXTREMA:
                index = self.index[len(res)]
                steps = torch.arange(t0, t1, device=index.device).view(k, *[1] * index.dim())
                res.append(torch.where(index == steps, g, 0))
            elif t1 == self.T:
                z = g.new_zeros((k, *g.shape))
                z[-1] = g
                res.append(z)
            else:
                res.append(None)
        return res
