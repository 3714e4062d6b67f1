"""Measure a model for planning: what one step costs in bytes and seconds, per block too.

"Probe" means this module: [`probe_model`][spikeckpt.planning.probe.probe_model] measures one
step of a wrapped model in the engine's one measuring room
([`probe_step`][spikeckpt.engine.measure.probe_step]: state bytes ``S``, bytes taped per step
``A`` after spike packing, output bytes, working bytes, forward/backward step time, the fixed
cost of one backward call, the storage tier's copy time) and adds the input's spike density;
[`block_sizes`][spikeckpt.planning.probe.block_sizes],
[`layerwise_working_bytes`][spikeckpt.planning.layer_working.layerwise_working_bytes] and
[`layerwise_seconds`][spikeckpt.planning.probe.layerwise_seconds] measure the layer-wise blocks.
Probes change nothing: no gradient is accumulated, the RNG is forked, the framework's hidden
state is cleaned up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import Tensor

from spikeckpt.engine import tree as pytree
from spikeckpt.engine.amp import autocast_on
from spikeckpt.engine.blocks import blocks_params, check_block_states, stacked_outputs
from spikeckpt.engine.fused import run_fused
from spikeckpt.engine.inputs import TrainWindow, chunk_of, is_packed, step_of
from spikeckpt.engine.layerwise import LayerBlock, layerwise_scan
from spikeckpt.engine.measure import (
    SEGMENT_PROBE_STEPS,
    Probe,
    probe_step,
    segment_seconds,
    step_costs,
    trainable_bytes,
    work_bytes,
)
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.engine.rng import CPU_STATE_BYTES, cuda_devices
from spikeckpt.engine.saved import SavedBytes
from spikeckpt.engine.step import unshaped
from spikeckpt.engine.tree import is_float, leaf_bytes, tree_flatten
from spikeckpt.planning.layer_working import (
    LAYERWISE_PROBE_CHUNKS,
    layerwise_chunk_step_bytes,
    layerwise_probe_chunks,
    layerwise_working_bytes,
    scaled_sizes,
)
from spikeckpt.plans.account import StepSizes
from spikeckpt.plans.layerwise import (
    BlockSizes,
    packed_bytes,
)
from spikeckpt.storage.base import tensor_nbytes
from spikeckpt.storage.codecs import is_binary

__all__ = [
    "LAYERWISE_PROBE_CHUNKS",
    "SEGMENT_PROBE_STEPS",
    "Probe",
    "Probed",
    "block_sizes",
    "apart_under_autocast",
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


def apart_under_autocast(sizes: StepSizes, readout: Any, probe: Probe, device: Any) -> StepSizes:
    """``sizes`` with what a stack run holds beside its plan where step 0 runs apart (under
    autocast, whose ops change the state's dtypes: `spikeckpt.engine.first_step`): step 0's
    tape, in your graph until the backward's end (``probe.step_bytes``, once), and a reducing
    readout's accumulator carried as state from step 1 on, in every checkpoint (a sum's in
    float32: up to twice a reduced-precision output's bytes; a fold's with its counter).
    Measured on a conv net (2-4-10, batch 4, ``readout="sum"``, float16): 20 KiB more after
    the forward than in float32, 160 bytes more per checkpoint; left out, 5 of 11 budgets ran
    1.008-1.018x over. Unchanged without autocast."""
    if not autocast_on(device):
        return sizes
    carried = 0
    if readout in ("sum", "mean"):
        carried = 2 * probe.output_bytes
    elif readout is not None and readout != "last":
        carried = probe.output_bytes + (8 if callable(readout) else 0)
    return replace(sizes, state=sizes.state + carried, work=sizes.work + probe.step_bytes)


def shaped_state(seq: Probed, x: Any, state: Any) -> Any:
    """``state``, or where step 0 sets its shape (``None``, empty or 0-d leaves: a neuron of
    yours whose state argument defaults to None) the state after one untaped step 0 (RNG
    forked, running statistics kept): the probes measure the steps ``scan`` checkpoints,
    those after step 0, which it runs apart."""
    if not unshaped(tree_flatten(state)[0]):
        return state
    device = compute_device(seq, x)
    leaves = [t for t in tree_flatten(state)[0] if isinstance(t, Tensor)]
    try:
        with (
            torch.random.fork_rng(devices=cuda_devices([*leaves, *seq.parameters_for_scan()])),
            torch.no_grad(),
            recompute_phase(),
        ):
            return seq.step(state, step_of(x, 0, device))[0]
    finally:
        seq.cleanup()


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
    check_block_states(blocks, states)
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
    params = blocks_params(blocks)

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
