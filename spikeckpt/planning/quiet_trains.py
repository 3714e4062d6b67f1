"""Whether a spike train that was all zeros at the probe's step stays binary later on.

[`block_sizes`][spikeckpt.planning.probe.block_sizes] judges a block's input train from one
step. Where the neuron below has a chunk kernel, the kernel says whether its output is spikes
(`ChunkKernel.binary_output`); elsewhere (a neuron of yours, a per-step neuron) the probe's
step decides, and an all-zero step proves nothing: a graded neuron (spikes times 2, times the
membrane) is silent at first. Counted bit-packed, stored dense, the training step would run
over its budget. `judge_quiet_trains` steps the blocks on (no gradients, RNG forked, running
statistics untouched) until each such train shows a non-zero, and judges it at that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from spikeckpt.engine.blocks import stacked_outputs
from spikeckpt.engine.inputs import step_of
from spikeckpt.engine.layerwise import LayerBlock
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.engine.rng import cuda_devices
from spikeckpt.plans.layerwise import BlockSizes
from spikeckpt.storage.codecs import is_binary

__all__ = ["judge_quiet_trains"]


def _quiet(blocks: Sequence[LayerBlock], sizes: Sequence[BlockSizes]) -> set[int]:
    """Blocks whose input train no kernel vouches for and whose probed step was all zeros."""
    return {
        i for i in range(1, len(blocks)) if blocks[i - 1].fused is None and sizes[i].density == 0.0
    }


def judge_quiet_trains(
    blocks: Sequence[LayerBlock],
    x: Any,
    states: Sequence[Any],
    sizes: Sequence[BlockSizes],
    device: torch.device,
) -> list[BlockSizes]:
    """``sizes`` with each quiet train (see the module docstring) judged at its first step
    with a non-zero: ``density`` None where that step is not exactly 0/1 (the train then
    counts dense), else its share of ones; one that stays all zeros through ``x (T, B, ...)``
    keeps 0.0 (the store packs it). Runs the blocks up to the last quiet train, per step, from
    ``states`` (each block's at t = 0), and only while some train is undecided."""
    quiet = _quiet(blocks, sizes)
    if not quiet:
        return list(sizes)
    judged = {i: sizes[i].density for i in quiet}
    last = max(quiet)
    states = list(states)
    try:
        with (
            torch.random.fork_rng(devices=cuda_devices([step_of(x, 0, device)])),
            torch.no_grad(),
            recompute_phase(),
        ):
            for t in range(int(x.shape[0])):
                h: Tensor = step_of(x, t, device)
                for i in range(last):
                    block = blocks[i]
                    z = block.synapse(h.unsqueeze(0))[0]
                    states[i], y = block.step(states[i], z)
                    h = stacked_outputs([y], block.name)[0]
                    if i + 1 in quiet and bool(h.any()):
                        quiet.discard(i + 1)
                        judged[i + 1] = float(h.float().mean()) if is_binary(h) else None
                if not quiet:
                    break
                last = max(quiet)
    finally:
        for block in blocks:
            block.cleanup()
    return [replace(b, density=judged[i]) if i in judged else b for i, b in enumerate(sizes)]
