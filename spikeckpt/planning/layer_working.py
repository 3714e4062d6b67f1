"""The layer-wise working-set probe: what a layer-wise training step holds besides its block
states and stored trains, measured as a function of the chunk length.

[`layerwise_working_bytes`][spikeckpt.planning.layer_working.layerwise_working_bytes] runs the
engine's own layer-wise forward and backward on the first steps of the input at a few chunk
lengths, held under the probe's room (`_ProbeLimit`), and returns a
[`MeasuredWorking`][spikeckpt.plans.layerwise.MeasuredWorking]; `spikeckpt.planning.probe`
re-exports it beside the model's and the blocks' other probes. Changes nothing: RNG forked,
no ``.grad`` touched, layers skip their side effects.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from spikeckpt.engine.blocks import blocks_params
from spikeckpt.engine.grad import leaves_behind
from spikeckpt.engine.inputs import chunk_of, is_packed
from spikeckpt.engine.layerwise import LayerBlock, layerwise_scan
from spikeckpt.engine.layerwise_job import GROUP_SHARE
from spikeckpt.engine.meter import MemoryMeter
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.engine.rng import cuda_devices
from spikeckpt.engine.tree import tree_flatten
from spikeckpt.plans.layerwise import (
    EXTRAPOLATION_MARGIN,
    BlockSizes,
    MeasuredWorking,
    layerwise_cost,
    steepest_chord,
)
from spikeckpt.storage.base import tensor_nbytes
from spikeckpt.storage.codecs import shape_numel
from spikeckpt.storage.spiketrain import SpikeTrain, concat_steps, packed_nbytes

__all__ = [
    "LAYERWISE_PROBE_CHUNKS",
    "PROBE_SAMPLES",
    "device_bytes",
    "layerwise_chunk_step_bytes",
    "layerwise_probe_chunks",
    "layerwise_working_bytes",
    "scaled_sizes",
]


def scaled_sizes(sizes: BlockSizes, batch: int, probed: int) -> BlockSizes:
    """Block sizes measured at batch ``probed``, for ``batch`` (bytes scale with the batch)."""
    if batch == probed:
        return sizes

    def scale(n: int) -> int:
        return -(-n * batch // probed)

    return replace(
        sizes,
        state_bytes=scale(sizes.state_bytes),
        step_bytes=scale(sizes.step_bytes),
        input_bytes=scale(sizes.input_bytes),
        output_bytes=scale(sizes.output_bytes),
        stored_state_bytes=None
        if sizes.stored_state_bytes is None
        else scale(sizes.stored_state_bytes),
    )


#: Chunk lengths `layerwise_working_bytes` runs (each over two chunks).
LAYERWISE_PROBE_CHUNKS = (1, 2, 4, 8, 16)
#: Every block untaped: the whole batch is measured at doubling chunk lengths until the
#: working set is this many times a chunk of one step's (`_longer`).
LONG_CHUNK_GROWTH = 3
#: `_longer`'s next length, as a ratio to the longest measured, the first the probe's limit
#: allows: a chord that ends shortly past a turn from the gradient sums' line to the chunk's
#: averages the two (Norse 512-512-32 at batch 1: flat up to chunk 32, 12.5 KB per step from
#: 32 to 64 and 22.3 KB per step past 64; its chunk 103 held 1.01x its budget)
LONGER_STEPS = ((2, 1), (3, 2), (5, 4))
#: Samples of the batch the tape's growth is measured on (two, so BatchNorm in training mode
#: has more than one value per channel; one when the batch is 1).
PROBE_SAMPLES = 2

#: the per-sample bytes of the working-set probe's first run, predicted from runs on
#: `PROBE_SAMPLES` and twice as many samples, are raised by this ratio (spike trains stored
#: as index lists vary per sample)
FIRST_RUN_MARGIN = (17, 16)


class _ProbeLimit:
    """Which chunk lengths a probe may still run under ``max_bytes``: each one's peak
    predicted from those measured so far (the last one plus the steepest chord per step, by
    `EXTRAPOLATION_MARGIN`, at least ``work`` bytes per step), its dense input beside it.
    A guess from the cost model's bytes per step alone missed what does not grow with the
    chunk (the gradient sums: 18 KB of a 24-32-10 ``RLeaky`` net's 20 KB at chunk 1), and
    its chunk 16 probe held 49.6 KB under a 47.2 KB limit. With one length measured (no
    chord), ``fewer`` (``(peak, samples, batch)``: the first run's own peak on fewer
    samples, its states and input left out as in ``runs``) gives the part of a chunk of one
    step that grows with the batch, scaled to the whole batch, which bounds what grows with
    the chunk (a Norse 64-512-10 net at batch 16 grew by 361 KB from chunk 1 to 2, the cost
    model by 176 KB, and its chunk 2 probe held 1.013x the budget; this bound: 561 KB); the
    whole peak per step would stop a net whose gradient sums are most of it (a 1024-wide
    ``RLeaky``: 13.9 of 14.2 MB) at chunk 1."""

    def __init__(
        self, max_bytes: int | None, work: int, fewer: tuple[int, int, int] | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.work = work
        self.fewer = fewer
        #: predict at no less than the last run's bytes per step (`_longer`'s runs, which
        #: look for the turn to a steeper line: a chord before it says too little)
        self.bounded = False
        self.peaks: list[tuple[int, int]] = []
        #: the dense input each recorded run made for itself (bytes)
        self.inputs: list[int] = []
        #: each run's own peak, less the ``held`` states it was given
        self.runs: list[int] = []

    def allows(self, chunk: int, input_bytes: int) -> bool:
        """Whether a run at ``chunk`` (longer than any measured) with ``input_bytes`` of
        dense input made for it fits."""
        if self.max_bytes is None or not self.peaks:
            return True
        last_chunk, last = self.peaks[-1]
        slope = steepest_chord(self.peaks, self.work)
        if self.bounded:
            slope = max(slope, -(-last // last_chunk))
        if len(self.peaks) == 1 and self.fewer is not None:  # no chord: the batch's part
            run, samples, batch = self.fewer
            grown = max(self.runs[0] - run, 0)
            slope = max(slope, -(-grown * batch // (batch - samples)))
        numerator, denominator = EXTRAPOLATION_MARGIN
        slope = -(-slope * numerator // denominator)
        return last + slope * (chunk - last_chunk) + input_bytes <= self.max_bytes

    def record(self, chunk: int, peak: int, input_bytes: int = 0, held: int = 0) -> None:
        """A run at ``chunk`` measured ``peak`` bytes (its initial states included, its
        ``input_bytes`` of dense input not)."""
        self.peaks.append((chunk, peak))
        self.inputs.append(input_bytes)
        self.runs.append(peak - held)


def layerwise_chunk_step_bytes(sizes: Sequence[BlockSizes], sparse_first: bool = False) -> int:
    """The cost model's bytes per chunk step of a layer-wise run, ``max_b (A_b + 2 I_b +
    O_b)`` (a chunk of one step holds at least about this much besides the block states and
    stored trains); with ``sparse_first`` (a packed input its synapse may read as positions,
    never differentiated) the first block's input counts once: a chunk too dense to gather
    over (and every chunk on a GPU) is made dense and saved for the weight's gradient, and
    a gather's positions hold about as much at the densest share it gathers at (three
    int64 indices per one: 24 bytes at a sixth of the elements against 4 per element)."""
    return max(
        b.step_bytes + (1 if sparse_first and i == 0 else 2) * b.input_bytes + b.output_bytes
        for i, b in enumerate(sizes)
    )


def layerwise_probe_chunks(
    T: int,
    sizes: Sequence[BlockSizes],
    max_bytes: int | None = None,
    lengths: Sequence[int] = LAYERWISE_PROBE_CHUNKS,
    headroom: int = 3,
) -> list[int]:
    """The chunk lengths `layerwise_working_bytes` measures for ``T`` steps under
    ``max_bytes`` (those of ``lengths`` up to ``T / 2`` and, with a limit, up to where
    ``headroom`` times the cost model's working set fits it; at least 1)."""
    longest = max(1, T // 2)
    if max_bytes is not None:
        longest = max(
            1, min(longest, max_bytes // (headroom * max(layerwise_chunk_step_bytes(sizes), 1)))
        )
    return sorted({k for k in lengths if k <= longest} or {1})


def layerwise_working_bytes(
    blocks: Sequence[LayerBlock],
    x: Any,
    states_for: Callable[[Tensor], list[Any]],
    sizes: Sequence[BlockSizes],
    *,
    device: torch.device,
    storage: str,
    readout: Any,
    output: str,
    stored_on_device: bool,
    max_bytes: int | None = None,
    fuse: bool = True,
    directory: str | os.PathLike[str] | None = None,
) -> MeasuredWorking:
    """Measure a layer-wise training step's working set, for the batch of ``x``, as a
    function of the chunk length ([`MeasuredWorking`][spikeckpt.plans.layerwise.MeasuredWorking]).

    The working set is what a step holds besides its block states and stored trains: one
    block's recomputed chunk, its tape, the gradients handed between blocks, and the running
    sums of the parameters' gradients. The cost model of
    [`layerwise_cost`][spikeckpt.plans.layerwise.layerwise_cost] counts ``chunk * max_b (A_b + 2 I_b +
    O_b)`` from one step's saved tensors; what the engine really allocates differs (the
    chunk's synaptic input, the stacked spikes and their gradients are more; the first
    block's tape without an input gradient, and the gradient sums, which peak while the other
    blocks' tapes are gone, are less than counted apart). This runs the engine's own
    layer-wise forward and backward, as the training step does (the whole batch, the
    parameters' gradients, an input gradient only when ``x`` requires grad), on the first
    steps of ``x`` at the chunk lengths of `LAYERWISE_PROBE_CHUNKS` (up to ``T / 2``;
    longer ones only while ``max_bytes`` allows them at three times the cost model's bytes per
    step; then at doubling lengths until the working set's line is the chunk's: `_longer`),
    two chunks each (the second chunk's gradients are summed out of place, as in a long
    run; a packed input stays packed, as the run reads it), under [`MemoryMeter`][spikeckpt.engine.meter.MemoryMeter], and subtracts the modeled states and
    stored trains. The peak is piecewise linear in the chunk (short chunks peak while the
    gradient sums are held, long ones while a long tape is), so the result is the measured
    bytes at the measured lengths (never falling as the chunk grows), the chords between
    them, and past the longest the steepest measured line (at least the cost model's slope).
    Changes nothing: RNG forked, no ``.grad`` touched (the gradients are returned, not
    accumulated), layers skip their side effects (BatchNorm's running statistics).

    Args:
        blocks: the model's layer-wise blocks.
        x: the input ``(T, B, ...)`` (dense or packed).
        states_for: ``x_t (B, ...) -> one initial state per block`` at ``x_t``'s batch.
        sizes: [`block_sizes`][spikeckpt.planning.probe.block_sizes] at the batch of ``x``.
        device: the compute device (``MemoryMeter`` measures it).
        storage: the tier the run stores its trains in (``"disk"`` writes its files in
            ``directory``, as the run does).
        readout, output: the run's readout and output.
        stored_on_device: whether the stored trains are device memory (the device tier, or
            the host tier on a CPU run).
        max_bytes: device bytes the probe may hold (None: no limit); its first run (chunk
            1, the whole batch) is predicted (`MeasuredWorking.probe_bytes`) and, where it
            does not fit, not made: the result then holds that one prediction.
        fuse: whether the run fuses the neurons that have a chunk kernel (as the probe does).
        directory: folder for the disk tier's temporary folder.
    """
    T, batch = int(x.shape[0]), int(x.shape[1])
    # a packed input's ones per step: each probe runs its length's densest chunk. They are
    # held on the host through the probes, and `_densest_start` sums them two steps or more
    # at a time: on a CPU run, room for both (4 and at most 2 bytes a step; 16 bytes a step,
    # uncounted, held 1.22x a budget at T = 20,000 and 3x at T = 100,000 before 2026-11-29)
    ones = x.step_ones(torch.int32) if is_packed(x) else None
    ones_held = 0 if ones is None or device.type != "cpu" else 6 * ones.numel()
    max_bytes = None if max_bytes is None else max_bytes - ones_held
    run = partial(
        _probe_residuals,
        blocks,
        x,
        states_for,
        device=device,
        storage=storage,
        readout=readout,
        output=output,
        remote=not stored_on_device,
        fuse=fuse,
        directory=directory,
        ones=ones,
    )
    few = min(batch, PROBE_SAMPLES)
    one = [scaled_sizes(b, few, batch) for b in sizes]
    sparse_first = is_packed(x) and blocks[0].sparse_synapse is not None
    # the first run's room, from a few samples: a probe held under less runs nothing more
    probe_bytes, small, fewer = _first_run_bytes(run, sizes, batch)
    if small is not None and max_bytes is not None and probe_bytes > max_bytes:
        # the whole batch's first run does not fit: what a few samples measured, scaled (an
        # over-estimate; the planner refuses layer-wise under this room anyway)
        first = small.scaled(batch, 2 * PROBE_SAMPLES).points[0]
        return MeasuredWorking((first,), layerwise_chunk_step_bytes(sizes), probe_bytes + ones_held)
    # the step itself at the shortest lengths: the whole batch, as the training step runs
    limit = _ProbeLimit(max_bytes, layerwise_chunk_step_bytes(sizes), fewer)
    step, untaped = run(
        sizes,
        layerwise_probe_chunks(T, sizes, max_bytes),
        samples=batch,
        training=True,
        limit=limit,
    )
    # what the first run held, when more than predicted (small batches: no prediction)
    probe_bytes = max(probe_bytes, limit.peaks[0][1] + limit.inputs[0]) + ones_held
    points, held = [], 0
    for k, r in step:  # the measured bytes never fall as the chunk grows
        held = max(held, r, 0)
        points.append((k, held))
    # the whole batch at longer chunks too: a step's peak moves as the chunk grows (short
    # chunks peak while the gradient sums are held, long ones while the chunk's tape or
    # buffers are), and a small batch shows another block's line. Untaped blocks: on
    # 700-256-256-20 at batch 32 it grows by 87 KB per step up to chunk 4, by 107 from 16 to
    # 32; on Linear(512, 512) + Leaky at batch 16 by 35 KB per step up to chunk 16 and 98 KB
    # past 32 (a chunk of 190 chosen from the short chords held 2.04x its budget). Taped: on
    # 128-128-10 with a packed input at batch 16 by 36 KB per step up to chunk 4 and 53 KB
    # from 8 to 16, where two samples grow by 4.5 KB per step throughout, 36 KB scaled (a
    # chunk chosen from them held 1.19x its budget)
    limit.bounded = True  # a conv net at batch 1: 21 KB per step up to chunk 8, 39 KB past it
    points, reached = _longer(points, partial(run, limit=limit), sizes, T, batch)
    # a probe stores two chunks; a run groups its stored trains into entries of up to
    # `GROUP_SHARE` of a chunk's dense trains, two of them held at once, which a remote tier
    # adds per step (137-147 KB per step in all on that Linear(512, 512); 2.1 KB per step on
    # a conv net at batch 1, whose chunk of 38 held 1.003x its budget without them)
    entries = 0
    if not stored_on_device:
        entries = math.ceil(2 * GROUP_SHARE * sum(b.input_bytes for b in sizes[1:]))
    points = [(k, w + k * entries) for k, w in points]
    floor = layerwise_chunk_step_bytes(sizes, sparse_first) + entries
    # stopped short of the chunk's line by the probe's limit: past the longest length the
    # working set grows by about what it holds per step there, at most (the line it turns to
    # holds the gradient sums too), or by the cost model's bytes per step, whichever is more.
    # Taped, on a conv net at batch 1 the chords up to chunk 8 grow by 21 KB per step, the
    # run by 39.5 KB past it, and the cost model counts 24.7 (a chunk of 14 held 1.05x its
    # budget); untaped, Norse 512-512-32 at batch 1 is flat up to chunk 32 and grows by 22.3
    # KB per step past 64, the cost model's taped bytes 16.4 (a chunk of 103 held 1.01x its
    # budget), where Linear(512, 512) + Leaky at batch 16 holds 107 KB per step at chunk 30
    # and grows by about 140 past it, the cost model's 139 (with the former alone, a chunk
    # of 56 held 1.03x its budget)
    bound = 0 if reached else -(-points[-1][1] // points[-1][0])
    if untaped:  # a few buffers per step, mostly below the cost model's taped bytes
        slope = steepest_chord(points, 0 if reached else max(floor, bound))
        return MeasuredWorking(tuple(points), slope, probe_bytes, floor)
    # and the tape's growth, the steepest line of a run on two samples without the
    # parameters' gradients and with an input gradient (every block taped alike: more than it
    # holds); a packed input never takes a gradient: its run tapes as the training step does
    # (the parameters' gradient sums, constant in the chunk, are in every point alike)
    tape, _ = run(
        one,
        layerwise_probe_chunks(T, one, max_bytes),
        samples=few,
        training=is_packed(x),
        limit=_ProbeLimit(max_bytes, layerwise_chunk_step_bytes(one)),
    )
    slope = steepest_chord(tape, layerwise_chunk_step_bytes(one, sparse_first))
    return MeasuredWorking(
        tuple(points), max(floor, -(-slope * batch // few) + entries, bound), probe_bytes
    )


def _first_run_bytes(
    run: Callable[..., tuple[list[tuple[int, int]], bool]],
    sizes: Sequence[BlockSizes],
    batch: int,
) -> tuple[int, MeasuredWorking | None, tuple[int, int, int] | None]:
    """The device bytes the working-set probe's first run (chunk 1, the whole batch) holds,
    its states and input included, predicted from runs on `PROBE_SAMPLES` and twice as many
    samples (memory is affine in the batch; the per-sample bytes raised by
    `FIRST_RUN_MARGIN`), the larger run's working set, and ``(the smaller run's own peak,
    PROBE_SAMPLES, batch)`` (`_ProbeLimit`'s ``fewer``). Batches up to twice
    `PROBE_SAMPLES` are run, not predicted: ``(0, None, None)``."""
    if batch <= 2 * PROBE_SAMPLES:
        return 0, None, None
    limits = {samples: _ProbeLimit(None, 0) for samples in (PROBE_SAMPLES, 2 * PROBE_SAMPLES)}
    points: dict[int, list[tuple[int, int]]] = {}
    for samples, limit in limits.items():
        points[samples], _ = run(
            [scaled_sizes(b, samples, batch) for b in sizes],
            [1],
            samples=samples,
            training=True,
            limit=limit,
        )
    small, large = limits[PROBE_SAMPLES], limits[2 * PROBE_SAMPLES]
    few, more = (lim.peaks[0][1] + lim.inputs[0] for lim in (small, large))
    numerator, denominator = FIRST_RUN_MARGIN
    per_sample = -(-max(more - few, 0) * numerator // (denominator * PROBE_SAMPLES))
    predicted = few + per_sample * (batch - PROBE_SAMPLES)
    working = MeasuredWorking(tuple(points[2 * PROBE_SAMPLES]), 0)
    return predicted, working, (small.runs[0], PROBE_SAMPLES, batch)


def _longer(
    points: list[tuple[int, int]],
    run: Callable[..., tuple[list[tuple[int, int]], bool]],
    sizes: Sequence[BlockSizes],
    T: int,
    batch: int,
) -> tuple[list[tuple[int, int]], bool]:
    """``points`` extended by runs of the whole batch at twice the longest measured length
    (or, where the probe's limit does not allow it, the longest of `LONGER_STEPS` it
    allows), again and again, until the working set has grown to `LONG_CHUNK_GROWTH` times
    what a chunk of one step holds (past there its line is the chunk's, no longer the
    gradient sums') or the length reaches ``T / 2``; and whether it got there (False: the
    probe's limit stopped it). The bytes never fall as the chunk grows."""
    points = list(points)
    longest = max(1, T // 2)
    while points[-1][0] < longest and points[-1][1] < LONG_CHUNK_GROWTH * max(points[0][1], 1):
        last_k, last = points[-1]
        for grown in LONGER_STEPS:  # the longest the probe's limit allows
            k = min(longest, max(last_k + 1, last_k * grown[0] // grown[1]))
            more, _ = run(sizes, [k], samples=batch, training=True)
            if more:
                break
        else:  # the probe's limit stops it
            return points, False
        points.append((more[0][0], max(last, more[0][1])))
    return points, True


def device_bytes(tree: Any, device: torch.device) -> int:
    """Bytes of the tensors of ``tree`` on ``device`` (each storage once)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tree_flatten(tree)[0]
        if isinstance(t, Tensor) and t.device == device
    }
    return sum(storages.values())


def _first_steps(x: Any, n: int, *, samples: int, device: torch.device, start: int = 0) -> Tensor:
    """Steps ``start <= t < start + n`` of the first ``samples`` samples of ``x``, dense
    ``(n, samples, ...)`` on ``device``, a tensor of their own."""
    if is_packed(x):  # one step at a time: never the whole chunk, nor a whole batch, dense
        first = x.step(start, device)[:samples]
        out = first.new_empty((n, *first.shape))
        out[0] = first
        del first  # a view holds the whole batch's step: one at a time only
        for t in range(1, n):
            out[t] = x.step(start + t, device)[:samples]
        return out
    return chunk_of(x, start, start + n, device)[:, :samples].detach().clone()


def _packed_steps(
    x: Any, n: int, *, samples: int, device: torch.device, start: int = 0
) -> SpikeTrain:
    """Steps ``start <= t < start + n`` of the first ``samples`` samples of the packed train
    ``x``, a packed train of their own on ``device`` in ``x``'s codec, packed a step at a time
    (`_group_steps`: a bit-packed group ends on a whole byte): never the whole chunk dense. A
    probe's chunk ``k`` made its ``2 k`` steps dense first (5.7 MB at chunk 32 of a
    700-256-20 net at batch 32, packed 0.18 MB), and the probe's limit counted them beside
    the run: under a 10 MiB budget it stopped at chunk 20, and the plan took chunk 32 where
    63 fits."""
    group = _group_steps(samples * shape_numel(x.shape[2:]))
    trains = []
    for a in range(0, n, group):
        steps = _first_steps(x, min(group, n - a), samples=samples, device=device, start=start + a)
        trains.append(SpikeTrain.from_dense(steps, codec=x.codec))
        del steps
    return concat_steps(trains)


def _group_steps(per_step: int) -> int:
    """Fewest steps of ``per_step`` elements whose bits fill whole bytes."""
    return 8 // math.gcd(per_step, 8)


def _packed_bytes(x: Any, n: int, samples: int, ones: int, step_bytes: int) -> int:
    """At most what `_packed_steps` holds for ``n`` steps with at most ``ones`` ones among
    them (``step_bytes``: one dense step of the samples): the train it makes, held twice
    while it concatenates, beside one whole step of the batch unpacked twice (`_first_steps`)
    and the group it packs (the group dense, its mask and, for an index list, its ones'
    positions: 40 bytes per one at most), and 1 KiB for the small tensors' alignment."""
    per_step = samples * shape_numel(x.shape[2:])
    group = min(n, _group_steps(per_step))
    whole = 2 * step_bytes * int(x.shape[1]) // samples
    train = packed_nbytes(x.codec, (n, samples, *x.shape[2:]), ones)
    index = x.codec == "index"
    packing = group * (step_bytes + (per_step if index else per_step // 4))  # dense, mask
    if index:  # the ones' positions
        packing += 40 * min(ones, group * per_step)
    return 2 * train + whole + packing + 1024


def _densest_start(ones: Tensor | None, chunk: int, n: int) -> int:
    """Where a probe of ``n`` steps at ``chunk`` starts: at the chunk of the run (chunks from
    step 0) with the most ones, or the one before it where the train ends first, given the
    ones of each step; 0 without them. A packed input's synapse reads the positions of its
    ones: a chunk denser than the first holds more (448 B over a named smallest budget at
    chunk 1, a 10% train of 80 steps)."""
    T = 0 if ones is None else int(ones.numel())
    if ones is None or n >= T:
        return 0
    whole = T // chunk  # the whole chunks' sums, then the last, shorter one's (no copy)
    sums = (
        ones if chunk == 1 else ones[: whole * chunk].reshape(whole, chunk).sum(1, dtype=ones.dtype)
    )
    if whole * chunk < T:
        sums = torch.cat([sums, ones[whole * chunk :].sum(0, keepdim=True, dtype=ones.dtype)])
    start = int(sums.argmax()) * chunk  # the first of equal chunks
    if start + n <= T:
        return start
    if start + chunk <= T and start >= n - chunk:  # the probe's second chunk
        return start - (n - chunk)
    return max(0, T - n)  # the last, shorter chunk: the probe's last steps


def _probe_residuals(
    blocks: Sequence[LayerBlock],
    x: Any,
    states_for: Callable[[Tensor], list[Any]],
    sizes: Sequence[BlockSizes],
    chunks: Sequence[int],
    *,
    samples: int,
    training: bool,
    device: torch.device,
    storage: str,
    readout: Any,
    output: str,
    remote: bool,
    limit: _ProbeLimit,
    fuse: bool = True,
    directory: str | os.PathLike[str] | None = None,
    ones: Tensor | None = None,
) -> tuple[list[tuple[int, int]], bool]:
    """``(chunk, measured peak less the modeled states and trains)`` of layer-wise runs over
    the first ``2 * chunk`` steps of ``samples`` samples of ``x``, for each of ``chunks`` that
    ``limit`` allows (the lengths increasing; it stops at the first it does not), and
    whether every block's backward ran untaped in all of them. With ``ones`` (a packed
    input's ones per step) each run's steps start at its chunk length's densest chunk.

    ``training``: the parameters' gradients are computed (returned, not accumulated) and the
    input's only when ``x`` requires grad, as in a training step; else no parameter gradient
    and an input gradient (each block's tape alike, the gradient sums left out)."""
    T = int(x.shape[0])
    work = layerwise_chunk_step_bytes(sizes)

    dense = partial(_first_steps, x, samples=samples, device=device)
    first = dense(1)
    step_bytes = tensor_nbytes(first[0])
    floating = first.is_floating_point()
    devices = cuda_devices([first])
    del first  # a step of the samples, not held beside the runs (their inputs count steps)
    # a packed train is run packed, as the step runs it (its first block reads the positions
    # of its ones, or unpacks a chunk at a time, inside the run's meter)
    packed = is_packed(x)
    input_grad = (
        floating and not packed and (bool(getattr(x, "requires_grad", False)) or not training)
    )
    # a leaf behind a computed block tensor (raw of a Norse p field 0.2 + sigmoid(raw)) is
    # not differentiated: autograd.grad to it would free the graph the real run needs
    params = blocks_params(blocks)
    # what a probe without gradients stops: the leaves, and those behind computed tensors
    leaves = [t for t in params if t.is_leaf] + leaves_behind(params)
    residuals: list[tuple[int, int]] = []
    all_untaped = True
    try:
        _frozen(leaves, training)
        # probing re-runs steps: layers skip their side effects (BatchNorm's running stats)
        with torch.random.fork_rng(devices=devices), recompute_phase():
            for k in chunks:
                n = min(T, 2 * k)
                start = _densest_start(ones, k, n)
                xs: Any
                input_bytes = n * step_bytes
                if packed:  # never differentiated; packed a step at a time (never dense)
                    most = int(ones[start : start + n].sum()) if ones is not None else input_bytes
                    input_bytes = _packed_bytes(x, n, samples, most, step_bytes)
                if not limit.allows(k, input_bytes):
                    break
                if packed:
                    xs = _packed_steps(x, n, samples=samples, device=device, start=start)
                else:
                    xs = dense(n, start=start).requires_grad_(input_grad)
                states = states_for(xs.step(0) if packed else xs[0].detach())
                # again: an initial state may mark one requiring grad (Norse's IAFCell: its v
                # is p.v_reset, requires_grad)
                _frozen(leaves, training)
                run = partial(
                    layerwise_scan,
                    blocks,
                    chunk=k,
                    storage=storage,
                    directory=directory,
                    readout=readout,
                    output=output,
                    params=params if training else [],
                    fuse=fuse,
                )
                wrt = (params if training else []) + ([xs] if input_grad else [])
                held = device_bytes(states, device)  # made outside the run's meter
                peak, untaped = _run_peak(run, xs, states, wrt, device)
                del xs, states
                limit.record(k, peak + held, input_bytes, held)
                all_untaped = all_untaped and untaped
                modeled = layerwise_cost(n, k, sizes, remote=remote).peak_bytes
                residuals.append((k, peak - (modeled - k * work)))
    finally:
        if not training:
            for p in leaves:
                p.requires_grad_(True)
        for block in blocks:
            block.cleanup()
    return residuals, all_untaped


def _run_peak(
    run: Callable[[Tensor, list[Any]], Any],
    xs: Tensor,
    states: list[Any],
    wrt: list[Tensor],
    device: torch.device,
) -> tuple[int, bool]:
    """Measured device peak of ``run(xs, states)`` and the gradients of its outputs (ones)
    w.r.t. ``wrt`` (returned, not accumulated), and whether every block's backward ran
    untaped (`spikeckpt.engine.direct`) on every chunk."""
    with MemoryMeter(device) as meter:
        result = run(xs, states)
        (ys, _), stats = result, result.stats  # the final states held, as a step holds them
        del result
        outs = [y for y in tree_flatten(ys)[0] if y.requires_grad]
        if outs and wrt:
            found = torch.autograd.grad(
                outs, wrt, [torch.ones_like(y) for y in outs], allow_unused=True
            )
            del found
        del ys, outs
    untaped = sum(b.untaped_chunks for b in stats.blocks)
    return meter.peak_bytes, stats.backward_chunks > 0 and untaped == stats.backward_chunks


def _frozen(params: list[Tensor], training: bool) -> None:
    """Outside training (a step without gradients, measured taped), the blocks' tensors stop
    requiring grad for the probe (``params``: leaves; a computed one, a Norse ``p`` field
    computed before the call, stops with the leaves behind it); the caller turns them on
    again."""
    if not training:
        for p in params:
            p.requires_grad_(False)
