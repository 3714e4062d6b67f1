"""The stack granularity's `UnlistedParamsError`, told with the layers that use the tensors.

The whole step used tensors requiring grad that the engine was not given (neither
parameters nor tensor attributes of the model's modules); `unlisted_error` finds the layers
whose step uses them by stepping the layers one by one, in a diagnostic run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from spikeckpt.adapters.protocol import LayerAdapter, State
from spikeckpt.adapters.sequential import StackAdapter
from spikeckpt.engine.grad import behind_computed, unseen_leaves, used_both_ways
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.engine.tree import tree_leaves, tree_map
from spikeckpt.errors import UnlistedParamsError

__all__ = ["layers_using", "unlisted_error"]


def unlisted_error(
    adapter: LayerAdapter,
    err: UnlistedParamsError,
    state: State,
    x_t: Tensor,
    params: Sequence[Tensor] = (),
) -> UnlistedParamsError:
    """``err`` with the layers that use its tensors, found from ``state`` and step 0's
    input ``x_t (B, ...)``; told apart where they are behind a computed one of ``params``
    (the tensors the run differentiated)."""
    where = layers_using(adapter, state, x_t, err.tensors)
    found: list[Tensor] = [t for t in err.tensors if isinstance(t, Tensor)]
    shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in found[:5])
    names = ", ".join(repr(w) for w in where)
    if len(where) > 1:
        who = f"layers {names} use"
    else:
        who = f"layer {names} uses" if where else "the model uses"
    both = behind_computed(found, params)
    if both:
        return UnlistedParamsError(used_both_ways(who, both), both)
    return UnlistedParamsError(
        f"{who} {len(err.tensors)} tensor(s) requiring grad that are neither parameters "
        f"of the model nor tensor attributes of its modules (shapes {shapes}); "
        "they would get no gradient. Register them as nn.Parameter, or pass them: "
        "spikeckpt.wrap(model, ..., params=[tensor, ...])",
        err.tensors,
    )


def layers_using(adapter: LayerAdapter, state: State, x_t: Tensor, tensors: list[Any]) -> list[str]:
    """The paths of the layers whose step (from ``state``, input ``x_t`` detached) uses one of
    ``tensors``: a diagnostic run (random state forked, running statistics kept, the
    framework's leftovers cleared); empty when none is found."""
    wanted = {id(t) for t in tensors}

    def uses(roots: Any) -> bool:
        leaves = [t for t in tree_leaves(roots) if isinstance(t, Tensor)]
        return any(id(t) in wanted for t in unseen_leaves(leaves, []))

    def walk(adapter: LayerAdapter, state: State, x_t: Any) -> tuple[list[str], Any]:
        if not isinstance(adapter, StackAdapter):
            new, y = adapter.step(state, x_t)
            return ([adapter.path or "<root>"] if uses((new, y)) else []), y
        found: list[str] = []
        for i, layer in enumerate(adapter.layers):  # one step of each layer from its state
            paths, x_t = walk(layer, state[adapter.slots[i]], x_t)
            found += paths
            x_t = tree_map(lambda t: t.detach(), x_t)
        return found, x_t

    devices = [x_t.device.index or 0] if x_t.is_cuda else []
    try:
        with torch.random.fork_rng(devices=devices), recompute_phase(), torch.enable_grad():
            return walk(adapter, state, x_t.detach())[0]
    except Exception:  # noqa: BLE001 - a diagnostic only: the caller's error is what matters
        return []
    finally:
        adapter.cleanup()
