"""Readouts: the outputs a run builds from the per-step outputs ``y_t``, and their gradients.

One `Reducer` serves both granularities: the schedule executor emits one step at a time
(`Reducer.emit`), the layer-wise job one chunk of steps at a time
(`Reducer.emit_chunk`); sums run in time order either way, so both give the plain
loop's values bitwise. In the backward pass `Reducer.y_grad` gives ``dL/dy_t`` per step
and `Reducer.chunk_grad` per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Union

from torch import Tensor

__all__ = ["READOUTS", "Readout", "ReadoutFn", "Reducer", "YGrad", "check_readout"]

ReadoutFn = Callable[[Any, Any, int], Any]
Readout = Union[None, Literal["sum", "mean", "last"], ReadoutFn]  # noqa: UP007
YGrad = Callable[[int], Sequence[Tensor | None]]

#: the named readouts (a callable ``fold(acc, y_t, t) -> acc`` is the other kind)
READOUTS: tuple[str | None, ...] = (None, "sum", "mean", "last")


def check_readout(readout: Any) -> None:
    """Raise ``ValueError`` unless ``readout`` is a named readout or a callable."""
    if not (readout in READOUTS or callable(readout)):
        raise ValueError(
            f"readout must be None, 'sum', 'mean', 'last' or a callable, got {readout!r}"
        )


class Reducer:
    """Builds the outputs from ``y_t`` in the forward pass; gives ``dL/dy_t`` in backward.

    ``None``: stacked ``(T, ...)`` per output leaf. ``"sum"``: ``y_0 + y_1 + ...`` in time order.
    ``"mean"``: that sum divided by ``T``. ``"last"``: ``y_{T-1}``.
    """

    def __init__(self, kind: str | None, T: int) -> None:
        self.kind = kind
        self.T = T
        self.acc: list[Tensor] | None = None

    def emit(self, t: int, ys: Sequence[Tensor]) -> None:
        """Take the outputs ``ys`` (each ``(B, ...)``) of step ``t``."""
        kind, T = self.kind, self.T
        if kind is None:
            if self.acc is None:
                self.acc = [y.new_empty((T, *y.shape)) for y in ys]
            for buf, y in zip(self.acc, ys, strict=True):
                buf[t].copy_(y)
        elif kind in ("sum", "mean"):
            self.acc = (
                list(ys) if self.acc is None else [a + y for a, y in zip(self.acc, ys, strict=True)]
            )
        elif t == T - 1:
            self.acc = list(ys)

    def emit_chunk(self, t0: int, outs: Sequence[Tensor]) -> None:
        """Take the outputs of steps ``t0 .. t0 + k - 1`` at once (each ``(k, B, ...)``)."""
        if self.kind is None:
            if self.acc is None:
                self.acc = [o.new_empty((self.T, *o.shape[1:])) for o in outs]
            for buf, o in zip(self.acc, outs, strict=True):
                buf[t0 : t0 + o.shape[0]].copy_(o)
            return
        steps = [o.unbind(0) for o in outs]
        for i, ys in enumerate(zip(*steps, strict=True)):
            self.emit(t0 + i, ys)

    def outputs(self) -> list[Tensor]:
        """The readout's outputs (and forget them)."""
        acc, self.acc = self.acc or [], None
        if self.kind == "mean":
            return [a / self.T for a in acc]
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
            elif t1 == self.T:
                z = g.new_zeros((k, *g.shape))
                z[-1] = g
                res.append(z)
            else:
                res.append(None)
        return res
