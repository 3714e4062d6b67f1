"""spikeckpt's entry points under an outer ``torch.compile``.

``torch.compile(wrapped)``, ``wrapped.compile()`` or a compiled function that calls
[`scan`][spikeckpt.engine.scan.scan] would have dynamo trace spikeckpt's run (its planner,
storage threads and the one autograd Function), which it cannot: it failed after a minute of
recompiles with an internal guard error. The entry points therefore run as without
``torch.compile`` (a graph break; the user's code around them is still compiled), exactly as
eager, and say so once per call site. spikeckpt compiles its own kernels instead:
``wrap(..., compile=True)``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["NOT_TRACED", "OUTER_COMPILE", "eager_under_compile"]

F = TypeVar("F", bound=Callable[..., Any])

#: the warning an entry point gives when an outer ``torch.compile`` reaches it
OUTER_COMPILE = (
    "torch.compile does not trace into spikeckpt: this call runs as without torch.compile "
    "(exact; the code around it is still compiled). spikeckpt compiles its own kernels: "
    "wrap(..., compile=True) compiles the stack's step and the layer-wise fused neuron."
)

#: dynamo's reason for the graph break (its error's, under ``fullgraph=True``)
NOT_TRACED = (
    "spikeckpt's run is not traced by torch.compile: it runs eagerly at a graph break "
    "(fullgraph=True allows none: compile the code around the spikeckpt call without it). "
    "wrap(..., compile=True) compiles spikeckpt's own step and fused neuron."
)


def eager_under_compile(fn: F) -> F:
    """``fn``, run by an outer ``torch.compile`` as a call it does not trace (a graph break;
    under ``fullgraph=True`` dynamo's error gives `NOT_TRACED` as the reason), warning
    (``UserWarning``) that it ran eagerly."""

    @functools.wraps(fn)
    def noted(*args: Any, **kwargs: Any) -> Any:
        warnings.warn(OUTER_COMPILE, UserWarning, stacklevel=3)
        return fn(*args, **kwargs)

    try:
        eager = torch.compiler.disable(noted, reason=NOT_TRACED)
    except TypeError:  # torch < 2.8: no reason
        eager = torch.compiler.disable(noted)
    compiling = getattr(torch.compiler, "is_compiling", torch._dynamo.is_compiling)  # < 2.3

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        if compiling():
            return eager(*args, **kwargs)
        return fn(*args, **kwargs)

    return cast(F, entry)
