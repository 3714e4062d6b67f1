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

__all__ = ["OUTER_COMPILE", "eager_under_compile"]

F = TypeVar("F", bound=Callable[..., Any])

#: the warning an entry point gives when an outer ``torch.compile`` reaches it
OUTER_COMPILE = (
    "torch.compile does not trace into spikeckpt: this call runs as without torch.compile "
    "(exact; the code around it is still compiled). spikeckpt compiles its own kernels: "
    "wrap(..., compile=True) compiles the stack's step and the layer-wise fused neuron."
)


def eager_under_compile(fn: F) -> F:
    """``fn`` with dynamo disabled inside it, warning (``UserWarning``) when an outer
    ``torch.compile`` is tracing the caller."""
    eager = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            warnings.warn(OUTER_COMPILE, UserWarning, stacklevel=2)
        return eager(*args, **kwargs)

    return cast(F, entry)
