"""Whether the engine is recomputing steps: a flag that layers with side effects can read.

The engine evaluates every step once in the forward phase and again, some steps several
times, while it recomputes in the backward phase. A layer that updates something outside its
outputs on each call (``BatchNorm``'s running statistics) must do so only in the first
evaluation: it asks `recomputing`, which is ``True`` inside `recompute_phase`
(the engine enters it for its whole backward phase).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["recompute_phase", "recomputing"]

_RECOMPUTING: ContextVar[bool] = ContextVar("spikeckpt_recomputing", default=False)


def recomputing() -> bool:
    """``True`` while the engine re-evaluates steps it already ran in the forward phase."""
    return _RECOMPUTING.get()


@contextlib.contextmanager
def recompute_phase() -> Iterator[None]:
    """Mark the code inside as recomputation (the engine's backward phase)."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)
