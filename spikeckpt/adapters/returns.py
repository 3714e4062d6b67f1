"""What a layer's ``forward`` returns, read from its bytecode: the order of its states.

spikeckpt reads a step layer by arity: ``forward(x, s1, ..., sk) -> (y, s1, ..., sk)``, the
output first, then the states in the order the forward takes them. snnTorch's docstrings
write a one-step net the other way round, ``forward(x, mem1, spk1, mem2) -> (mem1, spk1,
mem2, spk2)``: read by arity it would run with every state in another's slot and no error.
Where every ``return`` is a tuple of plain local names, the names tell the two apart.
"""

from __future__ import annotations

import dis
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["returned_names", "state_order_problem"]

#: the opcodes that load one or two local variables (Python 3.10 to 3.13)
_LOADS = ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_DEREF")


def _loaded(ins: dis.Instruction) -> tuple[str, ...] | None:
    if ins.opname not in _LOADS:
        return None
    if isinstance(ins.argval, str):
        return (ins.argval,)
    if isinstance(ins.argval, tuple) and all(isinstance(a, str) for a in ins.argval):
        return tuple(ins.argval)
    return None


def returned_names(fn: Callable[..., Any]) -> list[tuple[str, ...]]:
    """For each ``return a, b, c`` of plain local names in ``fn``: the names, in order.
    Returns of anything else (a call, a nested tuple, a constant) are left out."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return []
    instrs = list(dis.get_instructions(code))
    found: list[tuple[str, ...]] = []
    for i, ins in enumerate(instrs):
        if ins.opname != "RETURN_VALUE" or i < 1 or instrs[i - 1].opname != "BUILD_TUPLE":
            continue
        size = instrs[i - 1].argval
        names: tuple[str, ...] = ()
        j = i - 2
        while j >= 0 and len(names) < size:
            loaded = _loaded(instrs[j])
            if loaded is None:
                break
            names = loaded + names
            j -= 1
        if len(names) == size:
            found.append(names)
    return found


def state_order_problem(forward: Callable[..., Any], n_state: int) -> str | None:
    """Why ``forward``'s returns cannot be read as ``(y, s1, ..., sk)``, or ``None``: a return
    names every state argument but not in the slots ``1..k`` in the order they are taken
    (``forward(x, mem1, spk1, mem2)`` returning ``mem1, spk1, mem2, spk2``)."""
    try:
        params = [
            p.name
            for p in inspect.signature(forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return None
    states = tuple(params[1 : 1 + n_state])
    if len(states) != n_state or len(set(states)) != n_state:
        return None
    for names in returned_names(forward):
        if len(names) != n_state + 1 or names[1:] == states or not set(states) <= set(names):
            continue
        taken = ", ".join(("x", *states))
        outputs = [n for n in names if n not in states]
        fix = (
            f"return {outputs[0]}, {', '.join(states)}"
            if len(outputs) == 1
            else "return the output first, then the states in the order forward takes them"
        )
        return (
            f"its forward({taken}) returns ({', '.join(names)}): spikeckpt reads a step as "
            f"forward(x, s1, ..., sk) -> (y, s1, ..., sk), the output first and then the states "
            f"in the order they are taken, so it would feed {names[1]} back as {states[0]} "
            f"(read from the names in its return statement). Write `{fix}` and unpack it that "
            f"way in your own loop"
        )
    return None
