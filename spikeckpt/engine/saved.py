"""Bytes autograd saves for taped steps: counted (and binary tensors packed) by the one hook
pair of `spikeckpt.storage.hooks`.

`measure_step` uses it to measure one step: ``S`` (state bytes) and ``A`` (bytes autograd saves).

``A`` is counted with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves
for backward adds ``numel * element_size`` bytes, except tensors whose storage is a parameter's
(weights saved by ``matmul`` cost no extra memory). Saved tensors are counted each time they
are saved (no de-duplication), so the count of a segment is the sum of its steps' counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from spikeckpt.engine.phase import recompute_phase
from spikeckpt.engine.rng import cuda_devices
from spikeckpt.engine.tree import is_float, leaf_bytes, tree_flatten
from spikeckpt.storage.hooks import SavedTensors

__all__ = ["SavedBytes", "StepSizes", "measure_step"]


#: The engine's tape counter: the one saved-tensor hook pair
#: ([`SavedTensors`][spikeckpt.storage.hooks.SavedTensors]): ``SavedBytes(exclude=params,
#: pack=...)``, ``.bytes`` the bytes held for backward (parameters' storages excluded).
SavedBytes = SavedTensors


@dataclass(frozen=True)
class StepSizes:
    """Result of `measure_step`.

    Attributes:
        state_bytes: ``S``, bytes of the state's tensors.
        step_bytes: ``A``, bytes autograd saves for one taped step (parameters excluded).
    """

    state_bytes: int
    step_bytes: int


def measure_step(
    step: Any,
    state: Any,
    x_t: Any,
    params: Sequence[Tensor] = (),
    *,
    fork_rng: bool = True,
    pack: bool = False,
) -> StepSizes:
    """Run ``step(state, x_t)`` once with a tape and measure ``S`` and ``A``.

    ``S`` is the larger of the state's bytes before and after the step (under autocast the
    step may return the state in another dtype; an unshaped initial state grows at step 0).

    The state's floating leaves are detached and made to require grad (as in an interior taped
    segment). The global RNG is left untouched when ``fork_rng`` is true. ``pack``: count
    binary saved tensors at their packed size (as ``scan(..., pack_tape=True)`` keeps them).
    """
    leaves, treedef = tree_flatten(state)
    state_bytes = leaf_bytes(leaves)
    # (a None leaf, a state step 0 builds: the step builds it here too)
    leaves = [
        t.detach().requires_grad_(is_float(t)) if isinstance(t, Tensor) else t for t in leaves
    ]
    with (
        torch.random.fork_rng(devices=cuda_devices(leaves), enabled=fork_rng),
        torch.enable_grad(),
        recompute_phase(),  # a probe step must not update running statistics (BatchNorm)
    ):
        with SavedBytes(exclude=params, pack=pack) as counter:
            out = step(treedef.unflatten(leaves), x_t)
        if isinstance(out, tuple) and len(out) == 2:
            # the state the run carries: step 0 may set its shape (an empty init_leaky())
            # or dtype (a float32 membrane from a bf16 input under autocast)
            after = [t for t in tree_flatten(out[0])[0] if isinstance(t, Tensor)]
            state_bytes = max(state_bytes, leaf_bytes(after))
        del out
    return StepSizes(state_bytes=state_bytes, step_bytes=counter.bytes)
