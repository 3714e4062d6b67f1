"""Measure a model for planning: what one step costs in bytes and seconds, per block too.

"Probe" means this module: [`probe_model`][spikeckpt.planning.probe.probe_model] measures one
step of a wrapped model in the engine's one measuring room
([`probe_step`][spikeckpt.engine.measure.probe_step]: state bytes ``S``, bytes taped per step
``A`` after spike packing, output bytes, working bytes, forward/backward step time, the fixed
cost of one backward call, the storage tier's copy time) and adds the input's spike density;
[`block_sizes`][spikeckpt.planning.probe.block_sizes],
[`layerwise_working_bytes`][spikeckpt.planning.probe.layerwise_working_bytes] and
[`layerwise_seconds`][spikeckpt.planning.probe.layerwise_seconds] measure the layer-wise blocks.
Probes change nothing: no gradient is accumulated, the RNG is forked, the framework's hidden
state is cleaned up.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from spikeckpt.engine import tree as pytree
from spikeckpt.engine.blocks import stacked_outputs
from spikeckpt.engine.fused import run_fused
from spikeckpt.engine.inputs import TrainWindow, chunk_of, is_packed, step_of
from spikeckpt.engine.layerwise import LayerBlock, layerwise_scan
from spikeckpt.engine.layerwise_job import GROUP_SHARE
from spikeckpt.engine.measure import (
    SEGMENT_PROBE_STEPS,
    Probe,
    probe_step,
    segment_seconds,
    step_costs,
    trainable_bytes,
    work_bytes,
)
from spikeckpt.engine.meter import MemoryMeter
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.engine.rng import CPU_STATE_BYTES, cuda_devices
from spikeckpt.engine.saved import SavedBytes
from spikeckpt.engine.tree import is_float, leaf_bytes, tree_flatten
from spikeckpt.plans.layerwise import (
    EXTRAPOLATION_MARGIN,
    BlockSizes,
    MeasuredWorking,
    layerwise_cost,
    packed_bytes,
    steepest_chord,
)
from spikeckpt.storage.base import tensor_nbytes
from spikeckpt.storage.codecs import is_binary

__all__ = [
    "LAYERWISE_PROBE_CHUNKS",
    "SEGMENT_PROBE_STEPS",
    "UNTAPED_PROBE_CHUNKS",
    "Probe",
    "Probed",
    "block_sizes",
    "compute_device",
    "layerwise_chunk_step_bytes",
    "layerwise_probe_chunks",
    "layerwise_working_bytes",
    "probe_model",
    "scaled_sizes",
    "segment_seconds",
    "step_costs",
    "step_work_bytes",
    "trainable_bytes",
]


class Probed(Protocol):
    """What a probe needs of a model (a [`CheckpointedSequence`][spikeckpt.wrapping.CheckpointedSequence] has it)."""

    pack_tape: bool
    directory: Any

    def step(self, state: Any, x_t: Any) -> tuple[Any, Any]: ...

    def parameters_for_scan(self) -> list[Tensor]: ...

    def cleanup(self) -> None: ...


def compute_device(seq: Any, x: Any) -> torch.device:
    """Where ``x``'s steps run: ``seq.device_for(x)`` when ``seq`` has it (a wrapped model:
    a packed train runs on the model's device), else ``x``'s device."""
    device_for = getattr(seq, "device_for", None)
    if device_for is not None:
        return torch.device(device_for(x))
    return x.device


def probe_model(
    seq: Probed, x: Any, state: Any, storage: str, *, max_bytes: int | None = None
) -> Probe:
    """Measure one step of ``seq`` on the first steps of ``x`` ``(T, B, ...)`` from ``state``
    ([`probe_step`][spikeckpt.engine.measure.probe_step], the one measuring room), and the input's
    spike density.

    ``x`` may be a packed spike train (its first steps are unpacked on the compute device).
    Changes nothing: gradients are taken with ``torch.autograd.grad`` (no ``.grad`` is
    touched), the RNG is forked, and the framework's per-module state is cleaned up.
    ``max_bytes``: device bytes the probe may hold at once (see ``probe_step``).
    """
    device = compute_device(seq, x)
    x_t = step_of(x, 0, device)
    try:
        probe = probe_step(
            seq.step,
            state,
            lambda t: x_t if t == 0 else step_of(x, t, device),
            int(x.shape[0]),
            seq.parameters_for_scan(),
            storage=storage,
            device=device,
            directory=getattr(seq, "directory", None) if storage == "disk" else None,
            pack=bool(getattr(seq, "pack_tape", False)),
            max_bytes=max_bytes,
            batch=int(x.shape[1]),
            # a dense input's step slices on the device are views of it, counted as the
            # input already: what autograd saves of them costs nothing more (as in scan)
            exclude=[x] if not is_packed(x) and x.device == device else [],
        )
    finally:
        seq.cleanup()
    density = None
    if x_t.is_floating_point() and x_t.numel() and (is_packed(x) or is_binary(x_t)):
        density = float(x_t.detach().mean())
    return replace(probe, input_density=density)


def step_work_bytes(seq: Probed, x: Any, state: Any, step_bytes: int) -> int:
    """`work_bytes` with the parameters' gradients, whatever the budget (one
    untaped step and one taped step with its backward; ``step_bytes`` is ``A``)."""
    device = compute_device(seq, x)
    try:
        return work_bytes(
            seq.step, state, step_of(x, 0, device), seq.parameters_for_scan(), step_bytes, device
        )
    finally:
        seq.cleanup()


def block_sizes(
    blocks: Sequence[LayerBlock], x_t: Tensor, states: Sequence[Any], fuse: bool = True
) -> list[BlockSizes]:
    """Measure each block for [`spikeckpt.plans.layerwise.layerwise_cost`][spikeckpt.plans.layerwise.layerwise_cost] with one taped
    step from ``states`` on the input step ``x_t`` ``(B, ...)``: its state bytes, the bytes
    autograd keeps (``A_b``; parameters excluded), its input and output bytes per step and the
    density of its input when that is binary (where the neuron below has a kernel, it says
    whether its output is: a graded spike's first step may be all zeros). A neuron the run
    fuses (``fuse`` and a kernel that takes the step) is counted by its fused chunk's growth
    per step instead (`_fused_step_bytes`), its stored state with its spike leaves bit-packed.
    Changes nothing (RNG forked, no gradients)."""
    params = [t for b in blocks for t in b.params]
    sizes: list[BlockSizes] = []
    h = x_t.detach()
    spikes: bool | None = None  # what the kernel below says of ``h``: None, the probe judges
    try:
        with (
            torch.random.fork_rng(devices=cuda_devices([h])),
            torch.enable_grad(),
            recompute_phase(),  # probe steps leave running statistics (BatchNorm) alone
        ):
            for block, state in zip(blocks, states, strict=True):
                leaves, spec = pytree.tree_flatten(state)
                leaves = [t.detach().requires_grad_(is_float(t)) for t in leaves]
                with SavedBytes(exclude=params) as synapse:
                    z = block.synapse(h.unsqueeze(0))[0]  # the run's own (chunk) synapse op
                with SavedBytes(exclude=params) as neuron:
                    new, y = block.step(pytree.tree_unflatten(leaves, spec), z)
                tape = synapse.bytes + neuron.bytes
                # the state as the run carries it: the dtypes one step returns (under autocast
                # snnTorch's float32 membrane from a bf16 start: twice the bytes)
                new_leaves = pytree.tree_flatten(new)[0]
                state_bytes = max(leaf_bytes(leaves), leaf_bytes(new_leaves))
                kernel = block.fused if fuse else None
                packing = _packing_saves(new_leaves, kernel.binary_leaves if kernel else ())
                del new, new_leaves  # the step's graph is freed before the fused chunk is measured
                y, z = stacked_outputs([y], block.name)[0].detach(), z.detach()
                stored = None
                if kernel is not None and kernel.accepts(leaves, z[None]):
                    tape = synapse.bytes + _fused_step_bytes(kernel, leaves, spec, z)
                    stored = state_bytes - packing
                binary = spikes is not False and is_binary(h)
                density = float(h.float().mean()) if binary else None
                rng = CPU_STATE_BYTES if block.draws_random and h.device.type == "cpu" else 0
                sizes.append(
                    BlockSizes(state_bytes, tape, _nbytes(h), _nbytes(y), density, rng, stored)
                )
                h = y.detach()
                spikes = block.fused.binary_output if block.fused is not None else None
    finally:
        for block in blocks:
            block.cleanup()
    return sizes


def _packing_saves(leaves: Sequence[Any], spikes: Sequence[int]) -> int:
    """Bytes the store saves on a state of ``leaves`` by bit-packing the leaves numbered in
    ``spikes`` (a fused kernel's ``binary_leaves``: its spikes, 0 or 1 by construction) that
    are exactly binary now; the store packs every binary leaf it keeps."""
    saved = 0
    for i in spikes:
        t = leaves[i] if i < len(leaves) else None
        if isinstance(t, Tensor) and is_binary(t):
            n = tensor_nbytes(t)
            saved += n - packed_bytes(n, 1.0, t.element_size())
    return saved


def _fused_step_bytes(kernel: Any, leaves: list[Tensor], spec: Any, z_t: Tensor) -> int:
    """A fused neuron's ``A_b``: the bytes its chunk keeps for backward per step (saved over 3
    steps less saved over 1, halved; the backward's own temporaries, like autograd's per
    step, are left to the measured working set), measured on one sample (the state
    ``leaves``' first, the input step ``z_t``'s first, repeated) and scaled to the batch."""
    batch = int(z_t.shape[0]) if z_t.dim() else 1
    one = [t[:1] for t in leaves]
    saved = []
    for k in (1, 3):
        z = z_t[:1].expand(k, *z_t[:1].shape).clone()
        z.requires_grad_(z.is_floating_point())
        with SavedBytes() as counter:
            run_fused(kernel, pytree.tree_unflatten(one, spec), z, False)
        saved.append(counter.bytes)
    return max(0, (saved[1] - saved[0]) * batch // 2)


def _nbytes(t: Tensor) -> int:
    return tensor_nbytes(t)


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
#: Longer chunk lengths the whole batch is measured at when every block runs untaped.
UNTAPED_PROBE_CHUNKS = (8, 16, 32)
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
    its chunk 16 probe held 49.6 KB under a 47.2 KB limit."""

    def __init__(self, max_bytes: int | None, work: int) -> None:
        self.max_bytes = max_bytes
        self.work = work
        self.peaks: list[tuple[int, int]] = []
        #: the dense input each recorded run made for itself (bytes)
        self.inputs: list[int] = []

    def allows(self, chunk: int, input_bytes: int) -> bool:
        """Whether a run at ``chunk`` (longer than any measured) with ``input_bytes`` of
        dense input made for it fits."""
        if self.max_bytes is None or not self.peaks:
            return True
        last_chunk, last = self.peaks[-1]
        numerator, denominator = EXTRAPOLATION_MARGIN
        slope = -(-steepest_chord(self.peaks, self.work) * numerator // denominator)
        return last + slope * (chunk - last_chunk) + input_bytes <= self.max_bytes

    def record(self, chunk: int, peak: int, input_bytes: int = 0) -> None:
        """A run at ``chunk`` measured ``peak`` bytes (its initial states included, its
        ``input_bytes`` of dense input not)."""
        self.peaks.append((chunk, peak))
        self.inputs.append(input_bytes)


def layerwise_chunk_step_bytes(sizes: Sequence[BlockSizes], sparse_first: bool = False) -> int:
    """The cost model's bytes per chunk step of a layer-wise run, ``max_b (A_b + 2 I_b +
    O_b)`` (a chunk of one step holds at least about this much besides the block states and
    stored trains); with ``sparse_first`` (a packed input its synapse reads as positions,
    never dense, never differentiated) the first block's input counts nothing."""
    return max(
        b.step_bytes + (0 if sparse_first and i == 0 else 2 * b.input_bytes) + b.output_bytes
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
    step), two chunks each (the second chunk's gradients are summed out of place, as in a
    long run), under [`MemoryMeter`][spikeckpt.engine.meter.MemoryMeter], and subtracts the modeled states and
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
    )
    few = min(batch, PROBE_SAMPLES)
    one = [scaled_sizes(b, few, batch) for b in sizes]
    sparse_first = is_packed(x) and blocks[0].sparse_synapse is not None
    # the first run's room, from a few samples: a probe held under less runs nothing more
    probe_bytes, small = _first_run_bytes(run, sizes, batch)
    if small is not None and max_bytes is not None and probe_bytes > max_bytes:
        # the whole batch's first run does not fit: what a few samples measured, scaled (an
        # over-estimate; the planner refuses layer-wise under this room anyway)
        first = small.scaled(batch, 2 * PROBE_SAMPLES).points[0]
        return MeasuredWorking((first,), layerwise_chunk_step_bytes(sizes), probe_bytes)
    # the step itself at the shortest lengths: the whole batch, as the training step runs
    limit = _ProbeLimit(max_bytes, layerwise_chunk_step_bytes(sizes))
    step, untaped = run(
        sizes,
        layerwise_probe_chunks(T, sizes, max_bytes),
        samples=batch,
        training=True,
        limit=limit,
    )
    # what the first run held, when more than predicted (small batches: no prediction)
    probe_bytes = max(probe_bytes, limit.peaks[0][1] + limit.inputs[0])
    points, held = [], 0
    for k, r in step:  # the measured bytes never fall as the chunk grows
        held = max(held, r, 0)
        points.append((k, held))
    if untaped:
        # every block untaped: a few buffers per step, far below the cost model's taped bytes;
        # but a step's peak moves between blocks as the chunk grows (on 700-256-256-20 at
        # batch 32 it grows by 87 KB per step up to chunk 4, by 107 from 16 to 32), and a
        # small batch shows another block's line: the whole batch is measured at longer
        # chunks. A probe stores two chunks; a run groups its stored trains into entries of
        # up to `GROUP_SHARE` of a chunk's dense trains, two of them held at once, which a
        # remote tier adds per step (measured 137-147 KB per step in all on that model)
        points = _longer(points, partial(run, limit=limit), sizes, T, batch, max_bytes)
        entries = 0
        if not stored_on_device:
            entries = math.ceil(2 * GROUP_SHARE * sum(b.input_bytes for b in sizes[1:]))
        return MeasuredWorking(tuple(points), steepest_chord(points, 0) + entries, probe_bytes)
    # taped blocks: the tape's growth, the steepest line of a run on two samples without the
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
        tuple(points),
        max(layerwise_chunk_step_bytes(sizes, sparse_first), -(-slope * batch // few)),
        probe_bytes,
    )


def _first_run_bytes(
    run: Callable[..., tuple[list[tuple[int, int]], bool]],
    sizes: Sequence[BlockSizes],
    batch: int,
) -> tuple[int, MeasuredWorking | None]:
    """The device bytes the working-set probe's first run (chunk 1, the whole batch) holds,
    its states and input included, predicted from runs on `PROBE_SAMPLES` and twice as many
    samples (memory is affine in the batch; the per-sample bytes raised by
    `FIRST_RUN_MARGIN`), and the larger run's working set. Batches up to twice
    `PROBE_SAMPLES` are run, not predicted: ``(0, None)``."""
    if batch <= 2 * PROBE_SAMPLES:
        return 0, None
    found: dict[int, tuple[int, list[tuple[int, int]]]] = {}
    for samples in (PROBE_SAMPLES, 2 * PROBE_SAMPLES):
        limit = _ProbeLimit(None, 0)
        points, _ = run(
            [scaled_sizes(b, samples, batch) for b in sizes],
            [1],
            samples=samples,
            training=True,
            limit=limit,
        )
        found[samples] = (limit.peaks[0][1] + limit.inputs[0], points)
    (few, _), (more, points) = found[PROBE_SAMPLES], found[2 * PROBE_SAMPLES]
    numerator, denominator = FIRST_RUN_MARGIN
    per_sample = -(-max(more - few, 0) * numerator // (denominator * PROBE_SAMPLES))
    return few + per_sample * (batch - PROBE_SAMPLES), MeasuredWorking(tuple(points), 0)


def _longer(
    points: list[tuple[int, int]],
    run: Callable[..., tuple[list[tuple[int, int]], bool]],
    sizes: Sequence[BlockSizes],
    T: int,
    batch: int,
    max_bytes: int | None,
) -> list[tuple[int, int]]:
    """``points`` extended by runs of the whole batch at `UNTAPED_PROBE_CHUNKS` past them
    (up to ``T / 2`` and, with a limit, while twice the cost model's taped bytes fit it: the
    probe's own input and states beside them); the bytes never fall as the chunk grows."""
    points = list(points)
    for k in UNTAPED_PROBE_CHUNKS:
        last_k, last = points[-1]
        if k <= last_k or k > T // 2:
            continue
        if max_bytes is not None and 2 * k * layerwise_chunk_step_bytes(sizes) > max_bytes:
            break
        more, _ = run(sizes, [k], samples=batch, training=True)
        if not more:  # the probe's limit stops it
            break
        points.append((k, max(last, more[0][1])))
    return points


def layerwise_seconds(
    blocks: Sequence[LayerBlock],
    x: Any,
    states_for: Callable[[Tensor], list[Any]],
    *,
    device: torch.device,
    storage: str,
    readout: Any,
    output: str,
    fuse: bool = True,
    chunks: tuple[int, int] = (4, 16),
    directory: str | os.PathLike[str] | None = None,
) -> tuple[float, float]:
    """Time the training step's layer-wise run: ``(seconds per step, seconds per chunk)``.

    Runs the engine's layer-wise forward and backward (parameters' gradients returned, not
    accumulated) on the first ``2 * long`` steps of ``x``, whole batch, at the two chunk
    lengths ``chunks = (short, long)`` (a warm-up run first: one-time checks of fused
    kernels, caches), and solves
    ``t(k) = n * per_step + ceil(n / k) * per_chunk`` from the two times (each the faster of
    two runs). Fused neurons, synapses and the tier's copies are in the times, as they run.
    Changes nothing: RNG forked, no ``.grad`` touched, layers skip their side effects.
    """
    T = int(x.shape[0])
    n = max(1, min(T, 2 * chunks[1]))
    xs = chunk_of(x, 0, n, device).detach() if not is_packed(x) else None
    params = list({id(t): t for b in blocks for t in b.params if t.requires_grad}.values())

    def run(chunk: int) -> float:
        inputs = xs if xs is not None else TrainWindow(x, 0, n)
        states = states_for(chunk_of(x, 0, 1, device)[0].detach())
        start = time.perf_counter()
        ys, _ = layerwise_scan(
            blocks, inputs, states, chunk=chunk, storage=storage, directory=directory,
            readout=readout, output=output, params=params, fuse=fuse,
        )  # fmt: skip
        outs = [y for y in tree_flatten(ys)[0] if y.requires_grad]
        if outs and params:
            torch.autograd.grad(outs, params, [torch.ones_like(y) for y in outs], allow_unused=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    short, long_ = min(chunks[0], n), min(chunks[1], n)
    if device.type == "cpu" and any(b.draws_random for b in blocks):
        # a drawing block keeps a generator state per chunk until the backward: few chunks
        short = max(short, long_ // 2)
    try:
        with torch.random.fork_rng(devices=cuda_devices([p for p in params])), recompute_phase():
            run(long_)  # warm-up
            t_short = min(run(short) for _ in range(2))
            t_long = min(run(long_) for _ in range(2)) if long_ != short else t_short
    finally:
        for block in blocks:
            block.cleanup()
    chunks_short, chunks_long = -(-n // short), -(-n // long_)
    if chunks_short == chunks_long:
        return t_long / n, 0.0
    per_chunk = max(0.0, (t_short - t_long) / (chunks_short - chunks_long))
    per_step = max(0.0, (t_long - chunks_long * per_chunk) / n)
    return per_step, per_chunk


def device_bytes(tree: Any, device: torch.device) -> int:
    """Bytes of the tensors of ``tree`` on ``device`` (each storage once)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tree_flatten(tree)[0]
        if isinstance(t, Tensor) and t.device == device
    }
    return sum(storages.values())


def _first_steps(x: Any, n: int, *, samples: int, device: torch.device) -> Tensor:
    """The first ``n`` steps of the first ``samples`` samples of ``x``, dense ``(n, samples,
    ...)`` on ``device``, a tensor of their own."""
    if is_packed(x):  # one step at a time: never the whole chunk dense
        return torch.stack([x.step(t, device)[:samples] for t in range(n)])
    return chunk_of(x, 0, n, device)[:, :samples].detach().clone()


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
) -> tuple[list[tuple[int, int]], bool]:
    """``(chunk, measured peak less the modeled states and trains)`` of layer-wise runs over
    the first ``2 * chunk`` steps of ``samples`` samples of ``x``, for each of ``chunks`` that
    ``limit`` allows (the lengths increasing; it stops at the first it does not), and
    whether every block's backward ran untaped in all of them.

    ``training``: the parameters' gradients are computed (returned, not accumulated) and the
    input's only when ``x`` requires grad, as in a training step; else no parameter gradient
    and an input gradient (each block's tape alike, the gradient sums left out)."""
    T = int(x.shape[0])
    work = layerwise_chunk_step_bytes(sizes)

    dense = partial(_first_steps, x, samples=samples, device=device)
    first = dense(1)
    step_bytes = tensor_nbytes(first[0])
    # a packed train is unpacked a chunk at a time during the step; the probe's input is
    # dense already (made outside the run's meter): count one dense chunk per chunk step
    unpacked = step_bytes if is_packed(x) else 0
    floating = first.is_floating_point()
    input_grad = floating and (bool(getattr(x, "requires_grad", False)) or not training)
    params = list({id(t): t for b in blocks for t in b.params if t.requires_grad}.values())
    residuals: list[tuple[int, int]] = []
    all_untaped = True
    try:
        if not training:
            for p in params:
                p.requires_grad_(False)
        # probing re-runs steps: layers skip their side effects (BatchNorm's running stats)
        with torch.random.fork_rng(devices=cuda_devices([first])), recompute_phase():
            for k in chunks:
                n = min(T, 2 * k)
                if not limit.allows(k, n * step_bytes):
                    break
                xs = dense(n).requires_grad_(input_grad)
                states = states_for(xs[0].detach())
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
                limit.record(k, peak + held, n * step_bytes)
                all_untaped = all_untaped and untaped
                modeled = layerwise_cost(n, k, sizes, remote=remote).peak_bytes
                residuals.append((k, peak + k * unpacked - (modeled - k * work)))
    finally:
        if not training:
            for p in params:
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
