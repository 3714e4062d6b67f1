"""A layer-wise block as the engine sees it: plain callables the adapters build
([`LayerBlock`][spikeckpt.engine.layerwise.LayerBlock]; `spikeckpt.engine.layerwise` runs them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from spikeckpt.engine import tree as pytree
from spikeckpt.engine.direct import AffineChunk
from spikeckpt.engine.fused import ChunkKernel
from spikeckpt.engine.grad import GradSink, not_behind
from spikeckpt.engine.inputs import SparseChunk
from spikeckpt.errors import UnsupportedLayerError

__all__ = ["LayerBlock", "blocks_params", "stacked_outputs"]

State = Any


@dataclass(frozen=True)
class LayerBlock:
    """One block of a feed-forward stack, as the engine sees it: plain callables.

    Attributes:
        name: the block's name in the model (its neuron's path), for messages and stats.
        synapse: the block's input over a chunk ``(k, B, ...)`` -> the neuron's input
            ``(k, B, ...)`` (stateless; may batch over time).
        step: the neuron's pure step ``(state, z_t (B, ...)) -> (state, y_t (B, ...))``.
        membrane: ``state -> membrane potential (B, ...)``, or None when it has none (or a
            tuple of ``(B, ...)`` tensors: each is an output of its own with ``output="mem"``
            or ``"both"``, e.g. snnTorch's ``(syn, mem)`` after the spikes).
        draws_random: whether ``synapse`` or ``step`` draw random numbers (replayed exactly).
        params: the tensors requiring grad that the block uses (its gradients' targets).
        cleanup: drops whatever the framework left on its modules (called after each run).
        sparse_synapse: optional ``synapse`` for inputs that need no gradient, cheaper on
            sparse inputs (equal to ``synapse`` up to float round-off). The engine uses it for
            the first block when ``x`` needs no gradient, in the forward pass and in the
            recomputation alike (so both compute the same values).
        fused: optional `ChunkKernel` running the neuron over a
            whole chunk (forward, recomputation and backward) with ``step``'s arithmetic;
            used where it accepts the chunk (and the run fuses), else ``step`` per step.
        affine: optional `AffineChunk`: the synapse (``synapse`` and ``sparse_synapse`` alike)
            when it is one affine map, written out; with a ``fused`` neuron the engine then
            recomputes and backpropagates the block over a chunk without taping it.
        sinks: ``(parameter, sink)`` pairs: the synapse's backward adds that parameter's
            gradient into the engine's running sum in place (`GradSink`), so no
            parameter-sized gradient is made per chunk.
        emits: where ``membrane`` returns state leaves, their indices (``pytree`` order):
            a ``fused`` kernel that `emits_states` then emits them per step (at the top, with
            ``output="mem"`` or ``"both"``); None: its membrane is ``membrane``'s tensor.
    """

    name: str
    synapse: Callable[[Tensor], Tensor]
    step: Callable[[State, Tensor], tuple[State, Tensor]]
    membrane: Callable[[State], Tensor | tuple[Tensor, ...] | None]
    draws_random: bool
    params: list[Tensor]
    cleanup: Callable[[], None]
    sparse_synapse: Callable[[Tensor | SparseChunk], Tensor] | None = None
    fused: ChunkKernel | None = None
    sinks: tuple[tuple[Tensor, GradSink], ...] = ()
    affine: AffineChunk | None = None
    emits: tuple[int, ...] | None = None


def blocks_params(blocks: Sequence[LayerBlock]) -> list[Tensor]:
    """The distinct tensors requiring grad that ``blocks`` differentiate (a probe's), without
    the leaves behind a computed one (`not_behind`: ``raw`` of a Norse ``p`` field
    ``0.2 + sigmoid(raw)``; differentiated in a probe, its graph was freed before the run)."""
    unique = {id(t): t for b in blocks for t in b.params if t.requires_grad}
    return not_behind(list(unique.values()))


def stacked_outputs(ys: list[Any], name: str) -> Tensor:
    """``torch.stack(ys)``: a block's per-step outputs ``(B, ...)`` over a chunk, refused with
    the way forward when the neuron's step returns anything but one tensor (a neuron of
    yours returning ``(spk, mem)`` as its output)."""
    if not isinstance(ys[0], Tensor):
        raise UnsupportedLayerError(
            f"layer {name!r}: its neuron returns a {type(ys[0]).__name__} at each step, and "
            "layer-wise granularity needs one tensor (the spikes the next block reads); use "
            "granularity='stack', which takes any output structure"
        )
    return torch.stack(ys)


def check_block_states(blocks: Sequence[LayerBlock], states: Sequence[Any]) -> None:
    """Refuse a state leaf that is not a tensor (a step counter kept as a Python ``int``),
    naming the block and the fix, as `scan` does for the stack. A ``None`` leaf, which the
    stack carries as it is, is an `UnsupportedLayerError` naming ``granularity="stack"``:
    ``granularity="auto"`` then runs the stack (it refused the model before 2026-11-29)."""
    for block, state in zip(blocks, states, strict=False):
        leaves = pytree.tree_flatten(state)[0]
        names = [f"its state leaf {i}" for i in range(len(leaves))]
        none = next((i for i, leaf in enumerate(leaves) if leaf is None), None)
        if none is not None:
            raise UnsupportedLayerError(
                f"layer {block.name!r}: its state leaf {none} is None, and layer-wise "
                "granularity needs every state leaf as a tensor (it stores the states of "
                "each chunk); use granularity='stack', which carries a None leaf as it is, "
                "or keep a tensor there"
            )
        pytree.refuse_non_tensor_leaves(leaves, names, where=f"layer {block.name!r}: ")
