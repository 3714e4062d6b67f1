"""The layer-wise working-set probe as the run: a packed input probed packed (never a dense
chunk beside the run), and the forward pass's kept transpose of a small weight measured."""

from __future__ import annotations

import pytest
import snntorch as snn
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spikeckpt
from spikeckpt import MemoryMeter, SpikeTrain
from spikeckpt.adapters.gather import Transposed
from spikeckpt.engine.inputs import TrainWindow
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.planning.layer_working import _packed_bytes, _packed_steps
from spikeckpt.storage.spiketrain import concat_steps


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 12),
    batch=st.integers(1, 5),
    features=st.integers(1, 19),
    density=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    codec=st.sampled_from(["bitpack", "index"]),
    window=st.booleans(),
    data=st.data(),
)
def test_packed_steps_are_the_dense_steps_within_the_bytes_counted(
    T: int, batch: int, features: int, density: float, codec: str, window: bool, data: st.DataObject
) -> None:
    """What the probe packs: the dense train's steps and first samples, in the train's own
    codec, holding no more than `_packed_bytes` says while it packs them."""
    generator = torch.Generator().manual_seed(T * 1000 + batch * 10 + features)
    dense = (torch.rand(T, batch, features, generator=generator) < density).float()
    train: SpikeTrain | TrainWindow = SpikeTrain.from_dense(dense, codec=codec)
    if window:  # a window of the train, as the engine hands a segment
        skip = data.draw(st.integers(0, T - 1))
        train, dense = TrainWindow(train, skip), dense[skip:]
    n = data.draw(st.integers(1, dense.shape[0]))
    start = data.draw(st.integers(0, dense.shape[0] - n))
    samples = data.draw(st.integers(1, batch))
    with MemoryMeter() as meter:
        got = _packed_steps(train, n, samples=samples, device=torch.device("cpu"), start=start)
    assert got.codec == codec and got.dtype == dense.dtype
    assert got.shape == (n, samples, features)
    want = dense[start : start + n, :samples]
    assert torch.equal(got.dense(), want) and got.ones == int(want.sum())
    ones = int(dense[start : start + n].sum())  # the whole batch's: what the probe knows
    assert meter.peak_bytes <= _packed_bytes(train, n, samples, ones, samples * features * 4)


@pytest.mark.parametrize("codec", ["bitpack", "index"])
def test_concatenated_steps_are_the_trains_one_after_the_other(codec: str) -> None:
    generator = torch.Generator().manual_seed(0)
    dense = (torch.rand(11, 3, 8, generator=generator) < 0.3).float()
    parts = [SpikeTrain.from_dense(dense[a:b], codec=codec) for a, b in ((0, 1), (1, 5), (5, 11))]
    joined = concat_steps(parts)
    assert joined.codec == codec and joined.ones == int(dense.sum())
    assert torch.equal(joined.dense(), dense)
    with pytest.raises(spikeckpt.ConfigError, match="one codec"):
        concat_steps(
            [
                parts[0],
                SpikeTrain.from_dense(dense[1:2], codec="bitpack" if codec == "index" else "index"),
            ]
        )
    odd = (torch.rand(3, 1, 5, generator=generator) < 0.5).float()  # 5 bits a step
    with pytest.raises(spikeckpt.ConfigError, match="inside a byte"):
        concat_steps([SpikeTrain.from_dense(odd, codec="bitpack")] * 2)


def test_a_probe_forward_keeps_the_transpose_the_backward_drops() -> None:
    weight = torch.randn(8, 5)
    kept = Transposed()
    with recompute_phase():  # a probe's forward pass: as the run's
        assert torch.equal(kept.of(weight), weight.t())
    with recompute_phase(backward=True):  # the engine's backward phase
        assert kept.of(weight) is None
    assert torch.equal(kept.of(weight), weight.t())


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(700, 256), snn.Leaky(beta=0.95), nn.Linear(256, 20), snn.Leaky(beta=0.95)
    )


def test_a_packed_input_under_a_tight_budget_plans_the_chunk_it_measures() -> None:
    """An SHD-shaped net (700-256-20, batch 32, 3% spikes) with a packed input at 10 MiB: the
    probe counted 2 k dense steps beside its run at chunk k (5.7 MB at 32), stopped short
    and the plan took chunk 43 here (0.75 of the budget; 32 at T = 1000, where chunk 63 runs
    1.2x faster). Probed packed: chunk 79 (0.89 of the budget)."""
    net = _net()
    generator = torch.Generator().manual_seed(0)
    x = SpikeTrain.from_dense((torch.rand(400, 32, 700, generator=generator) < 0.03).float())
    budget = 10 << 20
    seq = spikeckpt.wrap(net, plan="auto", budget=budget, readout="sum", granularity="layer")
    with MemoryMeter() as meter:
        meter.track(x.tensors())
        seq(x).sum().backward()
    chunk = seq.last_decision.chunk
    assert chunk is not None and chunk >= 48, seq.last_decision
    assert meter.peak_bytes <= budget, (meter.peak_bytes, chunk)
    # and the loop's gradients (float32 round-off: the gather sums in another order)
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    dense = x.dense()
    total = torch.zeros(())
    mem1, mem2 = net[1].reset_mem(), net[3].reset_mem()
    for t in range(dense.shape[0]):
        spk1, mem1 = net[1](net[0](dense[t]), mem1)
        spk2, mem2 = net[3](net[2](spk1), mem2)
        total = total + spk2.sum()
    total.backward()
    for got, want in zip(grads, (p.grad for p in net.parameters()), strict=True):
        assert float((got - want).norm() / want.norm()) < 1e-5
