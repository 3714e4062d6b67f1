"""Numba's ``njit`` as every compiled loop of the library uses it (shared by all layers, as
`spikeckpt.units`): lazily compiled per dtype, cached on disk, or None where Numba is not
installed (the callers then run their NumPy or torch code)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["jit", "numba"]

numba: ModuleType | None
try:  # pragma: no branch - numba is a dependency; a platform without its wheels runs NumPy
    import numba
except ImportError:  # pragma: no cover
    numba = None


def jit(function: Callable[..., Any]) -> Any:
    """``function`` compiled (lazily, per dtype, cached on disk), or None without Numba."""
    if numba is None:  # pragma: no cover
        return None
    return numba.njit(cache=True, nogil=True, boundscheck=False)(function)
