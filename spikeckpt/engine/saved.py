"""Bytes autograd saves for taped steps: counted (and binary tensors packed) by one hook pair.

`measure_step` uses it to measure one step: ``S`` (state bytes) and ``A`` (bytes autograd saves).

``A`` is counted with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves
for backward adds ``numel * element_size`` bytes, except tensors whose storage is a parameter's
(weights saved by ``matmul`` cost no extra memory). Saved tensors are counted each time they
are saved (no de-duplication), so the count of a segment is the sum of its steps' counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from spikeckpt.engine.phase import recompute_phase
from spikeckpt.engine.rng import cuda_devices
from spikeckpt.engine.tree import is_float, leaf_bytes, tree_flatten

__all__ = ["SavedBytes", "StepSizes", "backward_reserve", "measure_step"]


def _storage_ptr(t: Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested, meta...
        return None


def _unpack(saved: Any) -> Tensor:
    if isinstance(saved, Tensor):
        return saved
    from spikeckpt.storage.codecs import unpack

    return unpack(saved)


def _candidate(t: Tensor, min_numel: int) -> bool:
    return (
        (t.is_floating_point() or t.dtype == torch.bool)
        and t.layout == torch.strided
        and t.numel() >= min_numel
        and t.is_contiguous()
    )


class SavedBytes:
    """Context manager counting the bytes autograd saves inside it, optionally packing spikes.

    With ``pack``, every saved tensor that is exactly binary (floating or bool, contiguous, at
    least ``min_numel`` elements) is kept bit-packed or as an index list
    ([`spikeckpt.storage.codecs.pack`][spikeckpt.storage.codecs.pack]) and counted at its packed size; it is rebuilt
    bitwise on use. Other tensors are kept as detached aliases (no copy; detaching avoids the
    reference cycle an identity hook creates for saved outputs).

    Attributes:
        bytes: bytes held for backward so far (parameters' storages excluded).
    """

    def __init__(
        self, exclude: Iterable[Tensor] = (), *, pack: bool = False, min_numel: int = 1024
    ) -> None:
        self.bytes = 0
        self._exclude = {p for p in (_storage_ptr(t) for t in exclude) if p is not None}
        self._pack_fn = None
        if pack:
            from spikeckpt.storage.codecs import pack as pack_fn

            self._pack_fn = pack_fn
        self._min_numel = min_numel
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: Tensor) -> Any:
        ptr = _storage_ptr(t)
        if ptr is not None and ptr in self._exclude:
            return t.detach()
        if self._pack_fn is not None and _candidate(t, self._min_numel):
            packed = self._pack_fn(t)
            if packed.codec != "dense":
                self.bytes += packed.nbytes
                return packed
        self.bytes += t.numel() * t.element_size()
        return t.detach()

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


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
    leaves = [t.detach().requires_grad_(is_float(t)) for t in leaves]
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


def backward_reserve(params: Iterable[Tensor], state_bytes: int) -> int:
    """Device bytes a backward pass holds besides checkpoints and tapes, for budgets.

    Three times the bytes of the parameters that require grad (their accumulated gradient,
    the gradient one step adds, and autograd's buffer summing the two) and two states (the
    state's gradient carried between segments and the one being computed). Measured on a
    200-256-10 LIF stack: 3.1x the parameters' bytes above the modeled checkpoints and tapes.
    """
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return 3 * grads + 2 * state_bytes
