"""MemoryMeter: CPU storage tracker (TorchDispatchMode) and CUDA allocator statistics."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from spikeckpt.engine.meter import MemoryMeter, unmetered
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
def test_cuda_meter_does_not_count_the_gemm_libraries_workspaces() -> None:
    """A thread's first matrix product allocates cuBLAS's workspace (32 MiB on Hopper, kept
    for the process) and the backward's first one autograd's worker thread's: the meter
    allocates them at entry, so a small Linear's forward and backward in a fresh thread
    measures its tensors (under 1 MiB), as on an H200 it did not (64 MiB more per step)."""
    import threading

    from spikeckpt.engine.gemm_workspaces import warm_gemm_workspaces

    peaks: list[int] = []

    def fresh_thread() -> None:
        layer = nn.Linear(64, 64).cuda()
        x = torch.ones(32, 64, device="cuda", dtype=torch.bfloat16)
        with MemoryMeter("cuda") as m:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
            y.float().sum().backward()
            z = torch.mm(x.float(), x.float().T)
            del y, z
        peaks.append(m.peak_bytes)

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert peaks and 0 < peaks[0] < 1 << 20, peaks
    # empty_cache() frees the workspaces (Lightning calls it when a fit ends): the next meter
    # allocates them again before it measures (the H200's second Trainer.fit: 64 MiB over)
    torch.cuda.empty_cache()
    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert len(peaks) == 2 and 0 < peaks[1] < 1 << 20, peaks
    assert warm_gemm_workspaces(torch.device("cuda")) is True
    assert warm_gemm_workspaces(torch.device("cpu")) is False


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


# ------------------------------------------------------------------ mode="allocator" (profiler)


def test_allocator_mode_counts_known_allocations_after_the_block() -> None:
    before = torch.zeros(1000)
    with MemoryMeter(mode="allocator") as m:
        a = torch.ones(1000, dtype=torch.float64)  # 8000
        b = torch.ones(500)  # 2000
        del a, before  # `before` was allocated before the block: its free is not counted
        c = torch.ones(100)  # 400
        with pytest.raises(RuntimeError, match="after the with-block"):
            _ = m.peak_bytes
    assert m.peak_bytes == 10_000
    assert m.current_bytes == 2400
    assert m.mode == "allocator" and "peak_bytes=10000" in repr(m)
    del b, c


def test_allocator_mode_ignores_frees_of_blocks_from_before() -> None:
    """The allocator reports the free of a block it handed out while an earlier profiler ran
    (it knows that block's size): a block from before this meter is not subtracted."""
    with MemoryMeter(mode="allocator"):
        kept = torch.ones(256)  # 1024 bytes, allocated while profiling
    with MemoryMeter(mode="allocator") as m:
        del kept
        y = torch.ones(10)
    assert (m.peak_bytes, m.current_bytes) == (40, 40)
    del y


def test_allocator_mode_agrees_with_the_tracker_on_an_snntorch_loop() -> None:
    """Eager code: the tracker and the allocator's events give the same bytes (here exactly)."""
    snn = pytest.importorskip("snntorch")
    torch.manual_seed(0)
    lin, lif = torch.nn.Linear(64, 64), snn.Leaky(beta=0.9)
    x = (torch.rand(30, 4, 64) < 0.2).float()
    weight = torch.randn(64)

    def step() -> None:
        mem, total = torch.zeros(4, 64), torch.zeros(4, 64)
        for x_t in x:
            spk, mem = lif(lin(x_t), mem)
            total = total + spk
        (total * weight).sum().backward()
        lif.mem = lif.mem.detach()

    peaks = {}
    for mode in ("tensors", "allocator"):
        lin.zero_grad(set_to_none=True)
        with MemoryMeter(mode=mode) as m:
            step()
        peaks[mode] = (m.peak_bytes, m.current_bytes)
    assert peaks["allocator"] == peaks["tensors"], peaks
    assert peaks["allocator"][1] >= (64 * 64 + 64) * 4  # the gradients stay


def test_allocator_mode_sees_temporaries_inside_an_op() -> None:
    """``mm`` with an expanded gradient makes a contiguous copy inside the kernel: the allocator
    sees it, the tracker (which sees what ops return) does not; with a dense gradient they
    agree to the byte."""
    lin, x = torch.nn.Linear(256, 256), torch.randn(64, 256)
    grads = (256 * 256 + 256) * 4
    peaks = {}
    for mode in ("tensors", "allocator"):
        for name, loss in (("expanded", lambda: lin(x).sum()), ("dense", lambda: lin(x).square().sum())):  # fmt: skip
            lin.zero_grad(set_to_none=True)
            with MemoryMeter(mode=mode) as m:
                loss().backward()
            peaks[mode, name] = m.peak_bytes
    assert peaks["tensors", "dense"] == peaks["allocator", "dense"]
    assert peaks["tensors", "expanded"] == grads + 8  # + the loss and its gradient
    # + mm's own copy of the (64, 256) gradient, made before the bias gradient (1 KiB)
    assert peaks["allocator", "expanded"] >= grads + 64 * 256 * 4 - 256 * 4


def test_allocator_mode_track_counts_until_freed() -> None:
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(128, 128), torch.randn(16, 128)
    lin(x).square().sum().backward()  # gradients held before the step
    params = (128 * 128 + 128) * 4
    results = {}
    for mode in ("tensors", "allocator"):
        for p in lin.parameters():
            p.grad = torch.ones_like(p)
        with MemoryMeter(mode=mode) as m:
            held = [*lin.parameters(), *(p.grad for p in lin.parameters()), x]
            added = m.track(held)
            assert m.track(held) == 0  # each storage once
            del held
            lin.zero_grad(set_to_none=True)  # frees the tracked gradients: subtracted
            lin(x).square().sum().backward()  # new gradients
        results[mode] = (added, m.peak_bytes, m.current_bytes)
    assert results["allocator"] == results["tensors"], results
    added, peak, current = results["allocator"]
    assert added == 2 * params + x.numel() * 4
    assert current == 2 * params + x.numel() * 4  # old gradients freed, new ones held
    assert peak < 3 * params  # the old gradients were gone before the new ones came


def test_allocator_mode_runs_compiled_code_compiled() -> None:
    """The trap: under the tracker (a dispatch mode) dynamo skips the frame and the code runs
    eagerly; under the allocator meter the frame is captured and run as compiled."""
    from torch._dynamo.utils import counters

    assert not _get_current_dispatch_mode_stack(), "a dispatch mode leaked from an earlier test"
    x = torch.randn(64)
    captured = {}
    for mode in ("tensors", "allocator"):
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(lambda t: (t * 2 + 1).sin(), backend="eager")
        with MemoryMeter(mode=mode) as m:
            y = fn(x)
        captured[mode] = counters["frames"]["ok"]
        assert torch.equal(y, (x * 2 + 1).sin()) and m.peak_bytes >= 256
    torch._dynamo.reset()
    assert captured == {"tensors": 0, "allocator": 1}


@pytest.mark.slow
def test_allocator_mode_measures_the_fused_kernel() -> None:
    """Inductor fuses ``cos(3 * sin(2x + 1))`` into one kernel: the compiled run holds only its
    output (256 KiB); eager holds an intermediate beside it (512 KiB). The tracker measures
    the compiled function as eager. (The allocator first: torch up to 2.13 runs a compiled
    function eagerly for good once it was called under a dispatch mode, the tracker's; this
    test failed that way on the H200 machine's torch 2.11 and on torch 2.13 here.)"""
    assert not _get_current_dispatch_mode_stack(), "a dispatch mode leaked from an earlier test"
    x = torch.randn(1 << 16)
    fn = torch.compile(lambda t: ((t * 2 + 1).sin() * 3).cos())
    fn(x)  # compile outside the block
    peaks = {}
    for mode in ("allocator", "tensors"):
        with MemoryMeter(mode=mode) as m:
            y = fn(x)
        peaks[mode] = m.peak_bytes
        torch.testing.assert_close(y, ((x * 2 + 1).sin() * 3).cos(), atol=1e-4, rtol=1e-4)
        del y
    assert peaks == {"tensors": 2 * x.numel() * 4, "allocator": x.numel() * 4}


def test_allocator_mode_does_not_nest_and_leaves_cleanly() -> None:
    with MemoryMeter(mode="allocator"), pytest.raises(RuntimeError, match="does not nest"):
        MemoryMeter(mode="allocator").__enter__()
    m = MemoryMeter(mode="allocator")
    with pytest.raises(ZeroDivisionError), m:
        torch.empty(10)
        raise ZeroDivisionError
    assert m.peak_bytes == 40
    with m, MemoryMeter() as inner:  # usable again; a tracker meter nests inside it
        torch.empty(20)
    assert m.peak_bytes == 80 and inner.peak_bytes == 80


def test_allocator_mode_under_a_dispatch_mode_warns() -> None:
    """An allocator meter inside an open tracker would measure compiled code run eagerly."""
    with (
        MemoryMeter(),
        pytest.warns(UserWarning, match="runs eagerly"),
        MemoryMeter(mode="allocator") as m,
    ):
        torch.empty(10)
    assert m.peak_bytes == 40


def test_meter_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        MemoryMeter(mode="rss")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CUDA and the CPU only"):
        MemoryMeter("meta", mode="allocator")


@cuda
def test_cuda_allocator_mode_is_the_allocator_and_tensors_mode_the_tracker() -> None:
    torch.empty(1, device="cuda")
    for mode in ("auto", "allocator", "tensors"):
        with MemoryMeter("cuda", mode=mode) as m:
            x = torch.empty(1 << 20, device="cuda")
            y = torch.empty(1 << 20, device="cuda")
            del y
        assert (m.peak_bytes, m.current_bytes) == (8 << 20, 4 << 20), mode
        del x


def test_the_tensor_meter_counts_the_engines_generator_captures() -> None:
    """A generator state is made without an op (no dispatch): the engine's captures
    (`RngState.capture`) tell the tensor-mode meters of this thread, which count them until
    they are freed; the CPU generator's state is 5,056 bytes."""
    from spikeckpt.engine.rng import RngState

    with MemoryMeter() as m:
        kept = RngState.capture([])
        held = m.current_bytes
        del kept
    assert held == torch.get_rng_state().nbytes == 5056
    assert m.peak_bytes == 5056 and m.current_bytes == 0
    with MemoryMeter() as quiet:
        torch.get_rng_state()  # not the engine's: not seen (made without an op)
    assert quiet.peak_bytes == 0


@pytest.mark.parametrize("mode", ["tensors", "allocator"])
def test_unmetered_work_is_hidden_from_the_meters(mode: str) -> None:
    """One-time work (an adapter's check at first use) inside `unmetered` counts in no meter;
    what is allocated after it counts as before."""
    with MemoryMeter(mode=mode) as m:  # type: ignore[arg-type]
        held = torch.ones(1000)  # 4000 bytes
        with unmetered():
            scratch = torch.ones(100_000)
            del scratch
        more = torch.ones(500)  # 2000 bytes
        del held, more
    assert m.peak_bytes == 6000
