"""A long packed input's first call keeps its budget: the planner's probes pick each probe's
densest chunk from the input's ones per step, which were held as int64 and copied, 16 bytes a
step that no account held (h38: a layer-wise first call at T = 20,000 held 1.22x its budget,
3x at T = 100,000; the later calls 0.48x)."""

from __future__ import annotations

import snntorch as snn
import torch
from torch import nn

import spikeckpt
from spikeckpt.engine.meter import MemoryMeter
from spikeckpt.planning.layer_working import _densest_start

T, B = 20_000, 2


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), snn.Leaky(0.95), nn.Linear(64, 5), snn.Leaky(0.9))


def test_the_first_call_of_a_long_packed_input_keeps_its_budget(tmp_path) -> None:
    generator = torch.Generator().manual_seed(1)
    x = spikeckpt.SpikeTrain.from_dense((torch.rand(T, B, 20, generator=generator) < 0.05).float())
    net, budget = _net(), 256 * 1024
    seq = spikeckpt.wrap(
        net,
        plan="auto",
        budget=budget,
        granularity="layer",
        storage="disk",
        directory=tmp_path,
        readout="sum",
    )
    peaks = []
    for _ in range(2):
        net.zero_grad(set_to_none=True)
        with MemoryMeter() as meter:
            meter.track(x.tensors())
            seq(x).sum().backward()
        peaks.append(meter.peak_bytes)
    assert max(peaks) <= budget, peaks  # the first call held 420,560 bytes before
    assert list(tmp_path.iterdir()) == []


def test_the_densest_start_is_the_first_densest_chunk_without_a_padded_copy() -> None:
    ones = torch.tensor([0, 1, 0, 3, 0, 0, 2, 1, 0, 3, 0], dtype=torch.int32)
    # chunks of 2: [1, 3, 0, 3, 3, 0] -> the first densest starts at step 2
    assert _densest_start(ones, 2, 4) == 2
    # chunks of 3: [1, 3, 3, 3] (the last one shorter) -> the second, step 3
    assert _densest_start(ones, 3, 6) == 3
    assert _densest_start(ones, 1, 2) == 3  # step 3 alone holds 3
    # the densest chunk is the last, shorter one: the probe's last steps
    assert _densest_start(torch.tensor([0, 0, 0, 0, 5], dtype=torch.int32), 2, 4) == 1
    assert _densest_start(None, 2, 4) == 0
