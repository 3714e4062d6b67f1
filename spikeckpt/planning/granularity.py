"""Granularity: whether layer-wise pays for a model, and the layer-wise chunk that fits.

Both planners decide the granularity the same way (`spikeckpt.planning.budgeted.BudgetPlanner`
weighs them): with ``granularity="auto"`` layer-wise runs when the model splits into
feed-forward blocks, the readout is not callable, its modeled
whole step fits (the budget, else the stack plan's own modeled step) and its time, calibrated
by measured chunks, is at most `LAYERWISE_TIME_TOLERANCE` above the stack plan's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from spikeckpt.engine.inputs import is_packed, step_of
from spikeckpt.engine.layerwise import LayerBlock, chunk_length
from spikeckpt.errors import ConfigTypeError, UnsupportedLayerError
from spikeckpt.planning.choice import Planned
from spikeckpt.planning.layer_working import (
    layerwise_chunk_step_bytes,
    layerwise_probe_chunks,
    layerwise_working_bytes,
)
from spikeckpt.planning.probe import (
    block_sizes,
    compute_device,
    layerwise_seconds,
)
from spikeckpt.planning.quiet_trains import judge_quiet_trains
from spikeckpt.plans.account import host_is_device
from spikeckpt.plans.layerwise import (
    BlockSizes,
    MeasuredWorking,
    fitting_chunk,
    layerwise_cost,
)

__all__ = ["LAYERWISE_TIME_TOLERANCE", "chunk_for"]

#: ``granularity="auto"`` accepts a layer-wise time this much above the stack plan's (both
#: modeled, calibrated by what the probes measured).
LAYERWISE_TIME_TOLERANCE = 0.05

#: ``granularity="auto"`` without a budget weighs layer-wise within the stack plan's own
#: modeled whole step, and, with ``plan="auto"`` (whose memory is a yardstick, not a limit the
#: user set), where no chunk fits there, at its least modeled step if that is at most this
#: many times the plan's (Norse's LIFCell net 700-256-20, batch 32, T = 500: layer-wise 9.08
#: MiB at 0.53x the loop's time against `Uniform(23)`'s 6.50 MiB at 1.46x)
LAYERWISE_MEMORY_SLACK = 1.5


class Layered(NamedTuple):
    """A model's layer-wise blocks, their sizes for planning and the measured working set."""

    blocks: list[LayerBlock]
    sizes: list[BlockSizes]
    working: MeasuredWorking | None = None
    #: measured ``(seconds per step, seconds per chunk)`` of the training step's run
    seconds: tuple[float, float] | None = None


def chunk_for(plan: Any, T: int) -> int:
    """The layer-wise chunk length for ``plan`` (a planning rule): an int is itself; a plan
    with ``interval`` (``Uniform(k)``) or ``local_interval`` (``Double``) uses it; otherwise
    (None, ``"auto"``, other plans) ``ceil(sqrt(T))``. Clipped to ``[1, T]``."""
    if isinstance(plan, bool):
        raise ConfigTypeError("chunk/plan must be an int or a plan, not a bool")
    if isinstance(plan, int):
        return chunk_length(plan, T)
    k: Any = None
    if plan is not None and not isinstance(plan, str):
        k = getattr(plan, "interval", None) or getattr(plan, "local_interval", None)
    return chunk_length(None if k is None else int(k), T)


def layerwise_candidate(
    model: Planned,
    x: Any,
    state: Any,
    required: bool,
    *,
    max_bytes: int | None = None,
    skip_over: bool = False,
    graded: Collection[str] = (),
) -> Layered | None:
    """The blocks and their sizes when layer-wise can run, else None: made safe for a budget
    (the `BudgetPlanner`'s; both planners plan through it): stored spike trains are counted at
    the bit-pack size whatever their density now (the ``auto`` codec never stores more; the
    density of hidden spikes grows as the model trains, and index lists with it), dense with
    the device tier (it stores them unpacked), and so are the spike leaves of the stored
    chunk states; a train no kernel vouches for, all zeros at the first step, is judged at
    its first non-zero step (`judge_quiet_trains`); ``working`` is the training step's working set
    as `layerwise_working_bytes` measures it (held under
    ``max_bytes``; the parameters' gradient sums included). ``skip_over``: None, without
    measuring, when one chunk step of the cost model exceeds ``max_bytes`` (measuring a chunk
    of one step would hold more than that). ``graded``: the blocks (by name) whose input
    train a run stored dense though it was planned packed: counted dense.
    """
    blocks = model.layer_blocks(required)
    if blocks is None:
        return None
    device = compute_device(model, x)
    fuse = bool(getattr(model, "fuse", True))
    try:
        states = model.block_states(state)
        sizes = block_sizes(blocks, step_of(x, 0, device), states, fuse)
        sizes = judge_quiet_trains(blocks, x, states, sizes, device)
        sizes = [
            replace(b, density=None) if k.name in graded else b
            for k, b in zip(blocks, sizes, strict=True)
        ]
    except UnsupportedLayerError:  # a block's neuron returns no single tensor per step
        if required:
            raise
        return None
    unpacked = model.storage == "device"
    sizes = [
        replace(b, density=None, stored_state_bytes=None)
        if unpacked
        else replace(b, density=None if b.density is None else 1.0)
        for b in sizes
    ]
    sparse_first = is_packed(x) and blocks[0].sparse_synapse is not None
    step = layerwise_chunk_step_bytes(sizes, sparse_first)
    if skip_over and not required and max_bytes is not None and step > max_bytes:
        # one chunk step alone exceeds what the probe may hold: measuring the step (at a
        # chunk of 1 at least) would break the budget, and no layer-wise run fits it
        return None
    try:  # the probe runs blocks forward and backward: a layer may refuse layer-wise there
        return _measured_layered(model, x, blocks, sizes, device, fuse, max_bytes)
    except UnsupportedLayerError:  # a layer writing its input in place: the stack runs it
        if required:
            raise
        return None


def _measured_layered(
    model: Planned,
    x: Any,
    blocks: Any,
    sizes: list[Any],
    device: torch.device,
    fuse: bool,
    max_bytes: int | None,
) -> Layered:
    """`layerwise_candidate`'s blocks with their measured working set and times."""
    working = layerwise_working_bytes(
        blocks,
        x,
        lambda x_t: model.block_states(model.initial_state(x_t)),
        sizes,
        device=device,
        storage=model.storage,
        directory=getattr(model, "directory", None),
        readout=model.readout,
        output=model.output,
        stored_on_device=host_is_device(model.storage, device.type),
        fuse=fuse,
        max_bytes=max_bytes,
    )
    if max_bytes is not None and working.probe_bytes > max_bytes:
        return Layered(blocks, sizes, working, None)  # not run: the planner refuses it
    allowed = layerwise_probe_chunks(int(x.shape[0]), sizes, max_bytes)  # held like the probe
    seconds = layerwise_seconds(
        blocks,
        x,
        lambda x_t: model.block_states(model.initial_state(x_t)),
        device=device,
        storage=model.storage,
        directory=getattr(model, "directory", None),
        readout=model.readout,
        output=model.output,
        fuse=fuse,
        # the lengths the working-set probe ran (held under ``max_bytes``), no longer
        chunks=(allowed[0], max(allowed[0], min(allowed[-1], working.points[-1][0]))),
    )
    return Layered(blocks, sizes, working, seconds)


def layerwise_may_pay(model: Planned, x: Any) -> bool:
    """``granularity="auto"`` considers layer-wise for named readouts (a callable one runs
    in the stack only), whatever the input: layer-wise stores the blocks' output spikes (the
    input itself is referenced, as the stack's steps read it). Not while the model holds
    parameters swapped in for the call (``torch.func.functional_call``): layer-wise blocks
    hold the parameters they were built with, the stack runs with the call's."""
    return not callable(model.readout) and not model.params_swapped()


def _chunk_candidates(T: int, preferred: int) -> list[int]:
    """Chunk lengths to try, ``1..min(preferred, T)``: all of them up to 4096, else a
    geometric grid of about 2000."""
    top = max(1, min(preferred, T))
    if top <= 4096:
        return list(range(1, top + 1))
    return sorted({max(1, min(top, round(top ** (i / 2000)))) for i in range(2001)})


def fitting_layer_chunk(
    T: int,
    sizes: Sequence[BlockSizes],
    limit: int,
    preferred: int,
    *,
    remote: bool,
    working: MeasuredWorking | None = None,
) -> int | None:
    """The largest chunk ``<= preferred`` whose modeled layer-wise peak fits ``limit``, or
    None. With the trains and chunk states off the device the peak grows with the chunk
    ([`fitting_chunk`][spikeckpt.plans.layerwise.fitting_chunk] bisects; with a block that keeps a
    replay state per chunk it tries every length); on the device the stored
    chunk states shrink as the chunk grows, so the peak is not monotonic: chunks are tried
    from the longest down."""
    if remote:
        return fitting_chunk(T, sizes, limit, preferred, remote=True, working=working)
    for k in reversed(_chunk_candidates(T, preferred)):
        if layerwise_cost(T, k, sizes, remote=False, working=working).peak_bytes <= limit:
            return k
    return None


def _smallest_layerwise(
    T: int, sizes: Sequence[BlockSizes], *, remote: bool, working: MeasuredWorking | None = None
) -> int:
    """The least modeled layer-wise peak over all chunk lengths (chunks of one step when
    the states go off the device and no block keeps a replay state per chunk)."""
    if remote and not any(b.rng_bytes for b in sizes):
        return layerwise_cost(T, 1, sizes, remote=True, working=working).peak_bytes
    return min(
        layerwise_cost(T, k, sizes, remote=remote, working=working).peak_bytes
        for k in _chunk_candidates(T, T)
    )


def least_layerwise(
    T: int,
    sizes: Sequence[BlockSizes],
    working: MeasuredWorking,
    *,
    remote: bool,
    chunk: int | None = None,
) -> int:
    """The least modeled layer-wise peak with ``working``: at ``chunk`` when one is given,
    else at the best chunk."""
    if chunk is not None:
        return layerwise_cost(T, chunk, sizes, remote=remote, working=working).peak_bytes
    return _smallest_layerwise(T, sizes, remote=remote, working=working)


def smallest_probed_layerwise(
    T: int,
    sizes: Sequence[BlockSizes],
    working: MeasuredWorking,
    *,
    remote: bool,
    beside: int,
    unprobed: int,
    chunk: int | None = None,
) -> int:
    """The least layer-wise peak that a probe held under it would find enough (at ``chunk``
    when one is given, else at the best chunk).

    ``working`` was measured at every chunk length; a probe held under a budget measures the
    shorter ones only (`layerwise_probe_chunks`), and fewer
    lengths can model more at some chunks; its first run needs ``working.probe_bytes``
    of room. ``beside``: the step's other bytes (input, outputs); ``unprobed``: what the
    probe may not use (what the call holds while it plans: its input on the device and its
    state). Raised until the lengths that fit the named budget model no more than it (the
    lengths only grow, so this ends)."""

    def least(w: MeasuredWorking) -> int:
        return least_layerwise(T, sizes, w, remote=remote, chunk=chunk)

    first = working.probe_bytes + unprobed - beside  # the probe's first run fits
    need = max(least(working), first)
    while True:
        room = max(beside + need - unprobed, 0)
        probed = working.prefix(len(layerwise_probe_chunks(T, sizes, room)))
        again = max(least(probed), first)
        if again <= need:
            return need
        need = again
