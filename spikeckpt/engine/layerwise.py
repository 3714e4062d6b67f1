"""Layer-wise granularity: spike trains stored packed off the device, each block recomputed alone.

For a feed-forward stack of blocks (each a synapse, then one stateful neuron, given to the
engine as plain callables: [`LayerBlock`][spikeckpt.engine.layerwise.LayerBlock]), [`layerwise_scan`][spikeckpt.engine.layerwise.layerwise_scan] runs the time loop as
one job of the engine's autograd Function (`spikeckpt.engine.function`), with the
engine's readout, RNG replay, stats and gradient pieces.

Forward (no tape), time chunk by time chunk (``chunk`` steps each) and, inside a chunk, block by
block bottom-up:

- the block's **input spike train** of the chunk is stored in the tier (``"host"``, ``"disk"``
  or ``"device"``); host and disk pack it with the ``auto`` codec (bit-pack, or index list below
  the break-even density, chosen per chunk from its measured density; non-binary inputs are
  stored dense). The first block's input is the user's ``x``: it is referenced, not copied
  (it lives as long as the autograd graph anyway);
- the block's state at the start of the chunk is stored too (the chunk boundaries are the
  checkpoints; the state at t=0 is the Function's input, referenced);
- the synaptic input of the whole chunk is one call of the block's ``synapse`` on the
  ``(k, B, ...)`` chunk (the adapters batch per-sample layers over time); then the neuron runs
  step by step. When a block draws random numbers (Dropout in training mode) the RNG state at
  the start of each (chunk, block) is kept and restored in backward, so the masks replay.

Because the forward pass already runs block by block over a chunk, the backward recomputation
is the very same computation (same shapes, same order): the recomputed spikes are bitwise those
of the forward pass.

Backward: chunks in reverse; inside a chunk, blocks top-down. Each block is recomputed from its
stored input chunk and its state at the chunk start alone, taped for ``chunk`` steps, and
backpropagated with the gradient from the block above (the top block: the outputs' gradient)
and the state gradient carried from the later chunk; the gradient with respect to its input
chunk goes to the block below (for the first block: into ``x.grad`` when ``x`` requires grad).
One block's tape over one chunk is all the autograd memory alive at any time. The next chunk's
packed inputs and states are prefetched (the tiers' ``prefetch``) while the current chunk runs.

The plain loop computes ``W @ x_t`` per step; a batched synapse computes one matmul per chunk,
so outputs and gradients agree with the plain loop to float32 round-off (bitwise for
element-wise synapses; the matmul's blocking may differ in the last bit).

Not supported (use the stack granularity): callable readouts, inputs that are not a single
``(T, B, ...)`` tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from spikeckpt.engine import tree as pytree
from spikeckpt.engine.blocks import LayerBlock, check_block_states
from spikeckpt.engine.compiled import Compile
from spikeckpt.engine.function import run_job
from spikeckpt.engine.inputs import TrainWindow, as_input, is_packed
from spikeckpt.engine.layerwise_job import GROUP_SHARE, LayerwiseJob, _nbytes, _split
from spikeckpt.engine.outer_compile import eager_under_compile
from spikeckpt.engine.readout import READOUTS
from spikeckpt.engine.rng import cuda_devices
from spikeckpt.engine.stats import BlockStats, LayerwiseStats, ScanResult
from spikeckpt.errors import ConfigError, ConfigTypeError
from spikeckpt.storage.spiketrain import SpikeTrain

__all__ = ["GROUP_SHARE", "LayerBlock", "chunk_length", "layerwise_scan"]

_OUTPUTS = ("spikes", "mem", "both")

State = Any


def chunk_length(chunk: int | None, T: int) -> int:
    """Steps per chunk for ``T`` steps: ``chunk`` clipped to ``[1, T]``, or ``ceil(sqrt(T))``
    when None (choosing it from a plan is a planning rule:
    `spikeckpt.planning.granularity.chunk_for`)."""
    if chunk is None:
        return min(math.isqrt(max(T - 1, 0)) + 1, T)
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise ConfigTypeError(
            f"chunk must be an int or None, got {type(chunk).__name__}; for a plan's interval "
            "use spikeckpt.planning.granularity.chunk_for(plan, T)"
        )
    if chunk < 1:
        raise ConfigError(f"chunk must be >= 1, got {chunk}")
    return min(chunk, T)


@eager_under_compile
def layerwise_scan(
    blocks: Sequence[LayerBlock],
    x: Tensor | SpikeTrain | TrainWindow,
    states: Sequence[Any],
    *,
    chunk: int | None = None,
    storage: str = "host",
    readout: str | None = None,
    output: str = "spikes",
    params: Sequence[Tensor] | None = None,
    directory: str | os.PathLike[str] | None = None,
    stats: bool = False,
    group: int | None = None,
    fuse: bool = True,
    compile: Compile = False,
) -> Any:
    """Run a feed-forward stack of blocks over ``x (T, B, ...)`` with layer-wise checkpointing.

    Args:
        blocks: the blocks bottom-up (built by the adapters:
            [`spikeckpt.adapters.layered.layer_blocks`][spikeckpt.adapters.layered.layer_blocks]).
        x: the input train, time first. Binary inputs are best; anything works. A packed
            train (a [`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain], or a ``torch.sparse_coo`` train)
            stays packed where it is (host or device) and is unpacked one chunk at a time on
            the compute device (``x.chunk(a, b, device)``); it gets no gradient.
        states: one initial state per block (its neuron's state structure).
        chunk: steps per chunk: an int, or None (``ceil(sqrt(T))``); a plan's interval:
            `spikeckpt.planning.granularity.chunk_for`.
        storage: ``"host"`` (packed in CPU memory), ``"disk"`` (packed files) or ``"device"``
            (references, no packing) for the spike trains and chunk-boundary states.
        readout: ``None`` (outputs ``(T, B, ...)``), ``"sum"``, ``"mean"``, ``"last"``,
            ``"max"`` or ``"min"`` (the extremum over time, with ``max(0)``'s gradient).
        output: the top block's per-step output: ``"spikes"``, ``"mem"`` or ``"both"``.
        params: tensors to differentiate (default: every block's ``params``); a block that
            uses one of them outside its own ``params`` is differentiated with respect to it
            too (found in its taped graph). A tensor requiring grad that a block uses and
            that is in neither raises [`UnlistedParamsError`][spikeckpt.errors.UnlistedParamsError].
        directory: folder for the disk tier's temporary folder.
        stats: deprecated: return the old triple ``(ys, final_states, stats)``; the
            result's ``.stats`` holds the [`LayerwiseStats`][spikeckpt.engine.stats.LayerwiseStats].
        group: chunks per off-device store entry (None: see `GROUP_SHARE`).
        fuse: run a block's neuron over each chunk with its ``fused`` kernel where it has one
            and accepts the chunk (`spikeckpt.engine.fused`); False: one step at a time.
        compile: compile the fused neurons' forward (`spikeckpt.engine.compiled`):
            True, False, or ``"auto"`` (on CUDA, where measured faster on the first chunk).

    Returns:
        A [`ScanResult`][spikeckpt.engine.stats.ScanResult] ``(ys, final_states)`` (``ys`` a
        tensor, or a ``(spikes, mem)`` tuple with ``output="both"``; ``final_states`` one per
        block), its stats in ``.stats``.
    """
    x = _checked_input(x, blocks, states, readout, output)
    packed = is_packed(x)
    T = x.shape[0]
    # A neuron whose input reaches its spikes a step later (Norse's LSNN: a kernel's
    # ``input_delay``) over T = 1 gives the layers below it no gradient path in the loop
    # (.grad None), which the per-step tape reproduces and a fused kernel's zeros do not
    fuse = fuse and sum(getattr(b.fused, "input_delay", 0) for b in blocks) < T
    k = chunk_length(chunk, T)
    if params is None:
        params = list({id(t): t for b in blocks for t in b.params}.values())
    params = [p for p in params if p.requires_grad]
    leaves, defs, counts = _flat_states(states)
    st = LayerwiseStats(
        plan=f"layer-wise(chunk={k})",
        schedule=None,
        T=T,
        storage=storage,
        state_bytes=sum(_nbytes(t) for t in leaves),
        chunk=k,
        n_chunks=-(-T // k),
        blocks=[BlockStats(b.name) for b in blocks],
    )
    job = LayerwiseJob(
        blocks,
        defs,
        counts,
        list(params),
        T=T,
        chunk=k,
        readout=readout,
        output=output,
        storage=storage,
        directory=directory,
        stats=st,
        device=next((t.device for t in (*leaves, *params)), x.device) if packed else x.device,
        cuda=cuda_devices((*([] if packed else [cast(Tensor, x)]), *leaves, *params)),
        group=group,
        fuse=fuse,
        compile=compile,
    )
    if packed:
        job.referenced = []  # a packed train is immutable: nothing to check in backward
    tensors = [x, *leaves, *params]
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors):
        flat = run_job(job, tensors)
    else:
        with torch.no_grad():
            flat = job.run_forward(x, leaves, record=False)
    outs = flat[: job.n_outputs]
    finals = [
        pytree.tree_unflatten(ls, d)
        for ls, d in zip(_split(flat[job.n_outputs :], counts), defs, strict=True)
    ]
    ys: Any = outs[0] if len(outs) == 1 else tuple(outs)
    return ScanResult(ys, finals, st).legacy(stats, "layerwise_scan")


def _checked_input(
    x: Any, blocks: Sequence[LayerBlock], states: Sequence[Any], readout: Any, output: str
) -> Any:
    """``x`` as the run takes it (a ``torch.sparse_coo`` train packed), after checking the
    arguments of `layerwise_scan`."""
    if readout not in READOUTS:
        raise ConfigError(
            f"layer-wise granularity supports readout None, 'sum', 'mean', 'last', 'max' or "
            f"'min', got {readout!r}; use granularity='stack' for a callable readout"
        )
    if output not in _OUTPUTS:
        raise ConfigError(f"output must be one of {_OUTPUTS}, got {output!r}")
    x = as_input(x)
    if not (is_packed(x) or isinstance(x, Tensor)) or len(x.shape) < 2:
        raise ConfigError("layer-wise granularity needs x as one (T, B, ...) tensor or train")
    if len(states) != len(blocks) or not blocks:
        raise ConfigError(f"need one state per block ({len(blocks)}), got {len(states)}")
    if x.shape[0] == 0:
        raise ConfigError("inputs hold T=0 time steps; need T >= 1")
    check_block_states(blocks, states)
    return x


def _flat_states(states: Sequence[Any]) -> tuple[list[Tensor], list[Any], list[int]]:
    """Every block's state leaves in one list, each block's tree spec and leaf count."""
    leaves: list[Tensor] = []
    defs, counts = [], []
    for s in states:
        ls, d = pytree.tree_flatten(s)
        if not all(isinstance(t, Tensor) for t in ls):
            raise ConfigTypeError("block states must be tensors or pytrees of tensors")
        leaves.extend(ls)
        defs.append(d)
        counts.append(len(ls))
    return leaves, defs, counts
