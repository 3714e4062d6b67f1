"""A block's synapse written out: the affine map of a chunk, forward and backward, without
autograd (the engine's side).

The layer-wise engine's backward recomputes one block over one chunk and backpropagates
through it. Where the block is one affine map ``z = x @ W.T + b`` into a fused neuron
(`spikeckpt.engine.fused.ChunkKernel`), both halves have their backward written out, and the
engine runs the block's recomputation and backward as plain tensor ops: no taped graph, no
``autograd.grad`` per chunk, no float copy of the spikes the backward never reads. The
arithmetic is the one the forward pass ran (the same ops on the same values, so the same
spikes); the parameter gradients go into the engine's running sums in place.

The adapters build an `AffineChunk` for the synapses they recognise
(`spikeckpt.adapters.affine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload

import torch
from torch import Tensor

from spikeckpt.engine.fused import ChunkKernel, Emit
from spikeckpt.engine.inputs import SparseChunk

__all__ = ["AffineChunk", "Untaped", "UntapedParts", "untaped_backward", "untaped_parts"]


class AffineChunk(Protocol):
    """A block's synapse that is one affine map, over a chunk, without autograd.

    Attributes:
        params: the tensors it differentiates (weight, then bias when there is one).
    """

    @property
    def params(self) -> tuple[Tensor, ...]: ...

    def forward(
        self, x: Tensor | SparseChunk, sparse: bool, lead: int = 0
    ) -> tuple[Tensor, Any] | None:
        """``(z (lead + k, B, out), saved)``: rows ``lead..`` bitwise the values the block's
        synapse gives (its ``sparse_synapse`` when ``sparse``), the first ``lead`` room for
        the caller; or None where it declines (hooks, autocast, dtypes it does not handle:
        the engine then tapes the block)."""

    def backward(
        self,
        saved: Any,
        g_z: Tensor,
        want_input: bool,
        sums: Sequence[Tensor | None],
        need: Sequence[bool],
    ) -> tuple[Tensor | None, list[Tensor | None]]:
        """``(dL/dx (k, B, in) or None, sums)``: each parameter's gradient (where ``need``)
        added into its running sum ``sums[i]`` in place, or a new tensor where that is
        None; None where not needed."""


#: a block's kernel and affine synapse, and the run's indices of their parameters that
#: require grad (``-1`` for an affine one that does not)
UntapedParts = tuple[ChunkKernel, AffineChunk, list[int | None], list[int | None]]


def untaped_parts(
    kernel: ChunkKernel | None,
    affine: AffineChunk | None,
    params: Sequence[Tensor],
    mem_out: bool,
) -> UntapedParts | None:
    """What a block's untaped backward uses, or None where the block must be taped: no fused
    ``kernel`` or no ``affine`` synapse, a membrane output (``mem_out``) from a neuron without
    one, or a tensor requiring grad outside the run's ``params`` (the taped path names it)."""
    if affine is None or kernel is None or (mem_out and kernel.membrane is None):
        return None
    ids = {id(p): j for j, p in enumerate(params)}
    k_idx = [ids.get(id(p)) for p in kernel.params if p.requires_grad]
    a_idx = [ids.get(id(p)) if p.requires_grad else -1 for p in affine.params]
    if None in k_idx or None in a_idx:
        return None
    return kernel, affine, k_idx, a_idx


@dataclass
class Untaped:
    """What one block's untaped backward over a chunk found.

    Attributes:
        steps: the chunk's length (steps recomputed).
        input_grad: dL/d input chunk ``(k, B, in)``, or None when not wanted.
        state_grads: dL/d each state leaf at the chunk start.
        kernel_grads: dL/d each of the kernel's parameters that require grad.
        affine_grads: per affine parameter, its running sum (added into in place) or a new
            gradient; None where it needs none.
    """

    steps: int
    input_grad: Tensor | None
    state_grads: list[Tensor | None]
    kernel_grads: list[Tensor | None]
    affine_grads: list[Tensor | None]


@overload
def _as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor: ...
@overload
def _as_dtype(t: None, dtype: torch.dtype) -> None: ...
def _as_dtype(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def untaped_backward(
    kernel: ChunkKernel,
    affine: AffineChunk,
    x: Tensor | SparseChunk,
    leaves: list[Tensor],
    sparse: bool,
    want_input: bool,
    grads: list[Any],
    sums: Sequence[Tensor | None],
    emit: Emit = None,
) -> Untaped | None:
    """Recompute ``kernel(affine(x))`` over a chunk from the state ``leaves`` and backpropagate
    ``grads = [dL/d spikes, dL/d membranes, dL/d final state leaves]`` through it, without
    autograd (call under ``no_grad``; with ``emit``, the second is a tuple: dL/d each state
    leaf the kernel emitted, see `ChunkKernel`); the affine parameters' gradients go into ``sums``
    (see `AffineChunk.backward`). Gradients come out in their inputs' dtypes, as autograd
    hands them on. ``grads`` is emptied once read (its tensors can go before the synapse's
    backward); None, ``grads`` untouched, where the affine map or the kernel declines."""
    made = affine.forward(x, sparse, lead=1)
    if made is None:
        return None
    room, saved_affine = made
    del made
    z = room[1:]
    if not kernel.accepts(leaves, z):
        return None
    steps, z_dtype = z.shape[0], z.dtype
    # the kernel may keep its membranes over z (row 0 of the room: the state before)
    saved = kernel.forward(leaves, z, True, False, want_y=False, into=room)[3]
    del z, room
    k_params = [p for p in kernel.params if p.requires_grad]
    g_z, g_leaves, g_kernel = kernel.backward(
        saved,
        grads[0],
        list(grads[2]),
        grads[1],
        True,
        [True] * len(k_params),
        consume=True,
        emit=emit,
    )
    del saved
    grads.clear()
    assert g_z is not None
    need = [p.requires_grad for p in affine.params]
    g_in, g_affine = affine.backward(saved_affine, _as_dtype(g_z, z_dtype), want_input, sums, need)
    return Untaped(
        steps=steps,
        input_grad=g_in,
        state_grads=[_as_dtype(g, t.dtype) for g, t in zip(g_leaves, leaves, strict=True)],
        kernel_grads=[_as_dtype(g, p.dtype) for g, p in zip(g_kernel, k_params, strict=True)],
        affine_grads=g_affine,
    )
