"""MemoryMeter: CPU storage tracker (TorchDispatchMode) and CUDA allocator statistics."""

from __future__ import annotations

import pytest
import torch

from spikeckpt.engine.meter import MemoryMeter
from spikeckpt.storage.base import Ledger
from spikeckpt.storage.tiers import DiskStore

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_known_allocation() -> None:
    with MemoryMeter() as m:
        x = torch.empty(1000)
    assert m.peak_bytes == 4000
    assert m.current_bytes == 4000
    assert m.device == torch.device("cpu")
    del x


def test_freed_tensors_lower_current_but_not_peak() -> None:
    with MemoryMeter() as m:
        a = torch.ones(1000, dtype=torch.float64)  # 8000
        b = torch.ones(500)  # 2000
        assert m.peak_bytes == m.current_bytes == 10_000  # readable inside the block
        del a
        assert m.current_bytes == 2000
        c = torch.ones(100)  # 400
    assert m.peak_bytes == 10_000
    assert m.current_bytes == 2400
    del b, c


def test_views_and_in_place_ops_are_not_counted_again() -> None:
    before = torch.zeros(1000)
    with MemoryMeter() as m:
        x = torch.zeros(250)
        views = [x[:10], x.view(5, 50), x.t(), x.unsqueeze(0), x.detach(), x.reshape(50, 5)]
        x.add_(1).mul_(2)
        before.add_(1)  # in place on a tensor made before the block
        before[3:7].zero_()
        y = before.view(10, 100)
    assert m.peak_bytes == 1000
    del views, y


def test_tensors_alive_after_exit_are_no_longer_followed() -> None:
    with MemoryMeter() as m:
        x = torch.empty(100)
    del x  # freed after the block: current_bytes was fixed at exit
    assert m.current_bytes == 400 and m.peak_bytes == 400


def test_nested_meters_both_count() -> None:
    with MemoryMeter() as outer:
        a = torch.empty(1000)
        with MemoryMeter() as inner:
            b = torch.empty(500)
            del b
            c = torch.empty(250)
        del a
    assert inner.peak_bytes == 2000 and inner.current_bytes == 1000
    assert outer.peak_bytes == 6000 and outer.current_bytes == 1000
    del c


def test_exceptions_leave_the_meter_cleanly() -> None:
    m = MemoryMeter()
    with pytest.raises(ZeroDivisionError), m:
        torch.empty(10)
        raise ZeroDivisionError
    with MemoryMeter() as after:
        torch.empty(10)
    assert m.peak_bytes == 40 and after.peak_bytes == 40
    with m:  # a meter can be used again, one block at a time
        torch.empty(20)
    assert m.peak_bytes == 80
    with pytest.raises(RuntimeError, match="already in use"), m, m:
        pass


def test_backward_is_measured() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(100, 200)
    x = torch.randn(32, 100)
    loss = lin(x).square().sum()
    with MemoryMeter() as m:
        loss.backward()
    # At least the weight and bias gradients (200 * 100 + 200 floats) stay allocated.
    assert m.current_bytes >= (200 * 100 + 200) * 4
    assert m.peak_bytes >= m.current_bytes


def test_mlp_forward_and_backward_peak_is_in_a_sane_range() -> None:
    torch.manual_seed(0)
    batch, widths = 64, [128, 512, 512, 10]
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)]
    x = torch.randn(batch, widths[0])
    params = sum(p.numel() for layer in layers for p in layer.parameters())
    with MemoryMeter() as m:
        h = x
        for layer in layers[:-1]:
            h = torch.relu(layer(h))
        loss = layers[-1](h).square().mean()
        loss.backward()
    activations = batch * sum(widths[1:]) * 4  # outputs of every layer
    # When the first weight's gradient is made, every other gradient and the gradient of the
    # first layer's output are alive: a lower bound. Nothing should be counted twice.
    assert m.peak_bytes >= params * 4 + batch * widths[1] * 4
    assert m.peak_bytes <= 2 * (activations + params * 4)
    assert m.current_bytes >= params * 4  # .grad stays
    del loss


def test_disk_tier_reads_are_visible() -> None:
    store = DiskStore("cpu", Ledger())
    store.put(0, [torch.randn(1000)])
    store.flush()
    with MemoryMeter() as m:
        got = store.get(0)
    store.close()
    assert m.current_bytes == 4000
    del got


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_meter_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        MemoryMeter("cuda")


@cuda
def test_cuda_allocator_peak() -> None:
    torch.empty(1, device="cuda")  # initialise the context outside the block
    with MemoryMeter("cuda") as m:
        x = torch.empty(1 << 20, device="cuda")  # 4 MiB
        y = torch.empty(1 << 20, device="cuda")
        del y
    assert m.peak_bytes == 8 << 20
    assert m.current_bytes == 4 << 20
    assert m.device.type == "cuda" and m.device.index is not None
    del x


@cuda
def test_cuda_nested_meters_keep_the_outer_peak() -> None:
    with MemoryMeter("cuda") as outer:
        a = torch.empty(1 << 20, device="cuda")
        del a  # the outer peak (4 MiB) happened before the inner meter resets the statistic
        with MemoryMeter("cuda") as inner:
            b = torch.empty(1 << 18, device="cuda")
        del b
    assert outer.peak_bytes == 4 << 20
    assert inner.peak_bytes == 1 << 20
