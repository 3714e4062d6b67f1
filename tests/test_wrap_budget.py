"""``wrap(..., plan="auto", budget=...)`` keeps a forward and backward within the budget.

The budget covers what the wrapped model's training step holds beyond its parameters: the
input train while it is on the device, the outputs, the activations and checkpoints, the
engine's gradient buffers and the parameters' ``.grad``. Measured with
:class:`~spikeckpt.MemoryMeter` (the input counted through ``track``), for stack, layer and
auto granularity, an FC and a conv model, at the smallest budget a refusal names (passed
back), at 1.5 times that, and at an ample budget.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import spikeckpt
from spikeckpt.engine.meter import MemoryMeter
from spikeckpt.storage import SpikeTrain

snn = pytest.importorskip("snntorch")


def _fc() -> nn.Module:
    return nn.Sequential(
        nn.Linear(100, 256), snn.Leaky(beta=0.9), nn.Linear(256, 10), snn.Leaky(beta=0.9)
    )


def _conv() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 8, 3, padding=1),
        snn.Leaky(beta=0.9),
        nn.Flatten(),
        nn.Linear(8 * 12 * 12, 10),
        snn.Leaky(beta=0.9),
    )


CASES = {"fc": (_fc, (100, 8, 100)), "conv": (_conv, (30, 4, 2, 12, 12))}


def _input(shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return (torch.rand(shape, generator=generator) < 0.1).float()


def _peak(net: nn.Module, x: Any, budget: int, granularity: str) -> int:
    """Peak bytes of one forward and backward of the wrapped ``net``, input included."""
    seq = spikeckpt.wrap(net, budget=budget, granularity=granularity, storage="disk")
    net.zero_grad(set_to_none=True)
    with MemoryMeter() as meter:
        meter.track(x.tensors() if isinstance(x, SpikeTrain) else [x])
        out = seq(x)
        (out * torch.arange(1, out.shape[-1] + 1)).sum().backward()
        del out
    return meter.peak_bytes


def _first_call(
    net: nn.Module, x: Any, budget: int, *, weighted: bool = True, **options: Any
) -> tuple[int, int | None]:
    """Peak bytes of a new wrapper's first training step (its probes included, the input
    counted) at ``budget``, and the layer-wise chunk it ran; the loss weighs the outputs'
    last dimension (``weighted``) or sums them."""
    seq = spikeckpt.wrap(net, budget=budget, **options)
    net.zero_grad(set_to_none=True)
    with MemoryMeter() as meter:
        meter.track(x.tensors() if isinstance(x, SpikeTrain) else [x])
        out = seq(x)
        (out * torch.arange(1, out.shape[-1] + 1) if weighted else out).sum().backward()
        del out
    return meter.peak_bytes, seq.last_decision.chunk


def _named(net: nn.Module, x: Any, **options: Any) -> int:
    """The smallest budget a refusal at 4 KiB names."""
    with pytest.raises(spikeckpt.BudgetTooSmall) as info:
        _first_call(net, x, 4096, **options)
    return info.value.minimum_bytes


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("granularity", ["stack", "layer", "auto"])
def test_wrap_budget_is_kept_from_the_smallest_to_ample(name: str, granularity: str) -> None:
    make, shape = CASES[name]
    torch.manual_seed(0)
    net = make()
    x = _input(shape)
    with pytest.raises(spikeckpt.BudgetTooSmall, match="smallest budget that fits") as info:
        _peak(net, x, 4096, granularity)
    smallest = info.value.minimum_bytes
    assert smallest > 4096 and info.value.budget_bytes == 4096
    for budget in (smallest, smallest * 3 // 2, 64 << 20):
        peak = _peak(net, x, budget, granularity)
        assert peak <= budget, (budget, peak)


def test_a_packed_input_counts_its_packed_bytes_only() -> None:
    """The same budget that refuses nothing for a packed train: its smallest budget is below
    the dense train's, by about the dense input's bytes."""
    torch.manual_seed(0)
    net = _fc()
    x = _input((400, 8, 100))
    smallest = {}
    for form, inp in (("dense", x), ("packed", SpikeTrain.from_dense(x))):
        with pytest.raises(spikeckpt.BudgetTooSmall) as info:
            _peak(net, inp, 4096, "stack")
        smallest[form] = info.value.minimum_bytes
        assert _peak(net, inp, smallest[form], "stack") <= smallest[form]
    dense_bytes = x.numel() * x.element_size()
    assert smallest["dense"] - smallest["packed"] >= dense_bytes * 0.9


@pytest.mark.parametrize("framework", ["snntorch", "norse"])
def test_auto_at_the_named_smallest_budget_with_a_readout_keeps_it(framework: str) -> None:
    """``granularity="auto"``, ``readout="sum"``, at the budget the refusal names: the
    layer-wise probe, held under it, measured chunk 1 alone, and with no slope the working
    set was extrapolated flat: chunk 50 ran at 7x the budget (Norse) and 1.9x (snnTorch)."""
    torch.manual_seed(0)
    if framework == "norse":
        norse = pytest.importorskip("norse.torch")
        net: nn.Module = norse.SequentialState(
            nn.Linear(40, 32), norse.LIFCell(), nn.Linear(32, 4), norse.LICell()
        )
    else:
        net = nn.Sequential(nn.Linear(40, 32), snn.Leaky(0.9), nn.Linear(32, 4), snn.Leaky(0.9))
    x = _input((50, 8, 40))

    def peak(budget: int) -> int:
        seq = spikeckpt.wrap(net, budget=budget, granularity="auto", readout="sum")
        with MemoryMeter() as meter:
            meter.track([x])
            out = seq(x)
            (out[0] if isinstance(out, tuple) else out).sum().backward()
            del out
        return meter.peak_bytes

    with pytest.raises(spikeckpt.BudgetTooSmall) as info:
        peak(1024)
    smallest = info.value.minimum_bytes
    for budget in (smallest, smallest * 5 // 4, smallest * 2):
        assert peak(budget) <= budget, budget


def test_layerwise_under_cpu_autocast_counts_the_states_the_run_carries() -> None:
    """Under ``torch.autocast`` (CPU bf16) snnTorch returns a float32 membrane from a bf16
    start: the blocks' chunk states were counted at the start's bf16 bytes, half of what the
    run stores, and at the refusal's smallest budget chunk 2 measured 10% over it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(30, 32), snn.Leaky(0.9), nn.Linear(32, 5), snn.Leaky(0.9))
    x = _input((60, 8, 30))

    def peak(budget: int) -> int:
        seq = spikeckpt.wrap(net, budget=budget, granularity="layer", readout="sum")
        with torch.autocast("cpu", dtype=torch.bfloat16), MemoryMeter() as meter:
            meter.track([x])
            out = seq(x)
            out.float().sum().backward()
            del out
        return meter.peak_bytes

    with pytest.raises(spikeckpt.BudgetTooSmall) as info:
        peak(1024)
    smallest = info.value.minimum_bytes
    for budget in (smallest, smallest * 11 // 10):
        assert peak(budget) <= budget, budget


def test_a_constant_input_expanded_over_time_counts_one_step() -> None:
    """The docs' static input ``img.expand(T, *img.shape)`` (snnTorch tutorial 5, the
    population-coding tutorial) is a view of one step: its smallest budget is below the
    contiguous copy's by about the copy's bytes, and it works. (It used to count T steps:
    10.7 MB named for a step that measured 0.7 MB.)"""
    torch.manual_seed(0)
    net = _fc()
    img = _input((8, 100))
    smallest = {}
    for form, x in (("view", img.expand(400, 8, 100)), ("copy", img.expand(400, 8, 100) + 0)):
        with pytest.raises(spikeckpt.BudgetTooSmall) as info:
            _peak(net, x, 4096, "stack")
        smallest[form] = info.value.minimum_bytes
        assert _peak(net, x, smallest[form], "stack") <= smallest[form]
    copy_bytes = 400 * img.numel() * img.element_size()
    assert smallest["copy"] - smallest["view"] >= copy_bytes * 0.9


@pytest.mark.parametrize("form", ["dense", "packed"])
def test_layerwise_chunks_past_the_probed_lengths_stay_within_the_budget(form: str) -> None:
    """The probe measures chunks of up to 8 steps; larger budgets get chunks of 20 to 200,
    modeled by the tape's measured growth past them (the cost model's own slope alone was
    measured 3-10% over these budgets), and the budget is still used, not wasted."""
    torch.manual_seed(0)
    net = _fc()
    dense = _input((400, 16, 100))
    x: Any = dense if form == "dense" else SpikeTrain.from_dense(dense)
    with pytest.raises(spikeckpt.BudgetTooSmall) as info:
        _peak(net, x, 4096, "layer")
    smallest = info.value.minimum_bytes
    for factor in (3, 6):
        budget = smallest * factor
        seq = spikeckpt.wrap(net, budget=budget, granularity="layer", storage="disk")
        peak = _peak(net, x, budget, "layer")
        seq(x)
        chunk = seq.last_decision.chunk
        assert chunk is not None and chunk > 8
        # used, not wasted: the extrapolation is raised by a margin (and an untaped step's
        # by its stored entries' share): 0.70-0.78 of the budget measured here
        assert 0.65 * budget <= peak <= budget, (factor, budget, peak, chunk)


def _dropout_net(p: float) -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 32), nn.Dropout(p), snn.Leaky(beta=0.9), nn.Linear(32, 5), snn.Leaky(beta=0.9)
    )


def test_the_probe_counts_the_generator_state_a_drawing_cpu_step_keeps() -> None:
    """A CPU step that draws (Dropout in training) makes every checkpoint keep the CPU
    generator's state (5,056 bytes, made without an op): the probe says so, and the account's
    state includes it; in eval mode, or with ``p=0``, nothing is drawn nor counted. The probe
    cache keeps them apart (same code and shapes, another tape: p=0 saves no mask)."""
    from spikeckpt.engine.measure import probe_step

    x = (torch.rand(5, 2, 20) < 0.1).float()
    found = {}
    for p, training in ((0.2, True), (0.2, False), (0.0, True)):
        torch.manual_seed(0)
        net = _dropout_net(p).train(training)
        seq = spikeckpt.wrap(net)
        probe = probe_step(
            seq.step, seq.initial_state(x[0]), lambda t: x[t], 5,
            seq.parameters_for_scan(), storage="host", device=torch.device("cpu"),
        )  # fmt: skip
        found[p, training] = probe
        sizes = probe.sizes(seq.parameters_for_scan(), input_bytes=0, stacked=True)
        assert sizes.state == probe.state_bytes + probe.rng_bytes
    assert found[0.2, True].rng_bytes == torch.get_rng_state().nbytes == 5056
    assert found[0.2, False].rng_bytes == found[0.0, True].rng_bytes == 0
    assert found[0.2, True].step_bytes > found[0.0, True].step_bytes  # its mask


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["host", "disk"])
def test_a_drawing_cpu_model_keeps_its_budget_by_the_allocator(storage: str) -> None:
    """Dropout inside the step, stack plans on the CPU, every allocation counted
    (``MemoryMeter(mode="allocator")``: generator states included). Before the probe counted
    them: 1.12-9.36x the budget (T = 200; a `TwoLevel` plan's 200 disk checkpoints each kept
    its 5,056-byte generator state in memory); now within, from the smallest budget on."""
    torch.manual_seed(0)
    net = _dropout_net(0.2)
    x = _input((120, 2, 20))

    def peak(budget: int) -> int:
        seq = spikeckpt.wrap(net, budget=budget, granularity="stack", storage=storage)
        net.zero_grad(set_to_none=True)
        with MemoryMeter(mode="allocator") as meter:
            meter.track([x])
            out = seq(x)
            (out * torch.arange(1, out.shape[-1] + 1)).sum().backward()
            del out
        return meter.peak_bytes

    with pytest.raises(spikeckpt.BudgetTooSmall, match="smallest budget that fits") as info:
        peak(4096)
    smallest = info.value.minimum_bytes
    for budget in (smallest, smallest * 5 // 4, smallest * 3 // 2):
        assert peak(budget) <= budget, budget


def test_a_drawing_cpu_block_counts_its_replay_state_per_chunk() -> None:
    """Layer-wise: a block that draws (Dropout in its synapse) keeps the CPU generator's state
    per chunk for the recomputation; its measured sizes say so, the others' do not."""
    from spikeckpt.planning.probe import block_sizes

    torch.manual_seed(0)
    seq = spikeckpt.wrap(_dropout_net(0.2), granularity="layer", chunk=4)
    x = (torch.rand(8, 2, 20) < 0.1).float()
    blocks = seq.layer_blocks(True)
    assert blocks is not None
    states = seq.block_states(seq.initial_state(x[0]))
    sizes = block_sizes(blocks, x[0], states)
    assert [b.rng_bytes for b in sizes] == [torch.get_rng_state().nbytes, 0]


def test_the_probe_cache_keeps_apart_what_is_excluded() -> None:
    """A dense input's steps are views of it (excluded: counted as the input), a packed
    input's are new tensors the tape keeps: the same step code and shapes measure other step
    bytes, and a cached probe of one was returned for the other."""
    from spikeckpt.engine.measure import probe_step

    x = (torch.rand(5, 2, 20) < 0.5).float()
    seq = spikeckpt.wrap(_dropout_net(0.0))
    probes = [
        probe_step(
            seq.step,
            seq.initial_state(x[0]),
            lambda t: x[t],
            5,
            seq.parameters_for_scan(),
            storage="host",
            device=torch.device("cpu"),
            exclude=exclude,
        )  # fmt: skip
        for exclude in ([x], [])
    ]
    assert probes[0].step_bytes < probes[1].step_bytes  # the slices the first Linear saves


@pytest.mark.parametrize("storage", ["host", "disk"])
def test_layerwise_under_cpu_autocast_with_per_neuron_beta_keeps_a_fitting_budget(
    storage: str, tmp_path: Any
) -> None:
    """A mixed-precision fuzzer's case: ``Leaky`` with one beta per neuron under CPU bf16
    autocast. The blocks' sizes (measured from the bf16 initial state, which the fused kernel
    declines) left the kernel's one-time check against the neuron's own step to the first
    chunk that carries the float32 membrane: inside the probe's meter, 37,790 bytes at chunk 1
    where the step holds 320, so 16 KiB was refused, naming 1.17 KiB (from a second probe,
    the check done by then). The check is hidden from meters: 16 KiB runs, and the
    refusal's smallest budget works."""

    def peak(budget: int | str) -> tuple[int, Any]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 5), snn.Leaky(beta=torch.rand(5) * 0.5 + 0.5))
        x = torch.zeros(10, 1, 4)
        x[3, 0, 1] = x[7, 0, 2] = 1
        seq = spikeckpt.wrap(
            net, plan="auto", budget=budget, granularity="layer", storage=storage,
            output="mem", directory=tmp_path if storage == "disk" else None,
        )  # fmt: skip
        with (
            torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
            MemoryMeter() as meter,
        ):
            meter.track([x])
            out = seq(x)
            out.float().sum().backward()
            del out
        return meter.peak_bytes, seq.last_stats

    _, stats = peak("16KiB")
    assert stats.plan.startswith("layer-wise")
    with pytest.raises(spikeckpt.BudgetTooSmall) as info:
        peak(256)
    smallest = info.value.minimum_bytes
    assert 256 < smallest < 4096
    used, stats = peak(smallest)
    assert stats.plan.startswith("layer-wise") and used <= smallest


@pytest.mark.parametrize(("granularity", "batch"), [("layer", 4), ("auto", 4), ("layer", 8)])
def test_the_named_smallest_budget_holds_the_first_call_s_probes(
    granularity: str, batch: int
) -> None:
    """A convolution pooled down to a small readout (little weight, a large membrane): at the
    smallest budget its refusal named, layer-wise on the disk tier, the first call held
    933,972 bytes under 783,460 (the run itself 778,220; batch 8: 1,860,964 under
    1,552,884): the planner's probes counted neither the state the call holds while it
    plans nor their own chunk of one step. The refusal now names a budget whose first call
    keeps it, probes included (batch 8: the probe's first run predicted from 2 and 4
    samples)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 32, 3, padding=1),
        snn.Leaky(beta=0.9),
        nn.AvgPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 3 * 3, 4),
        snn.Leaky(beta=0.9),
    )
    x = _input((30, batch, 2, 12, 12))
    with pytest.raises(spikeckpt.BudgetTooSmall, match="smallest budget that fits") as info:
        _peak(net, x, 4096, granularity)
    smallest = info.value.minimum_bytes
    for budget in (smallest, smallest * 11 // 10):
        peak = _peak(net, x, budget, granularity)
        assert peak <= budget, (budget, peak)


@pytest.mark.parametrize("granularity", ["layer", "stack"])
def test_gradients_accumulated_from_an_earlier_call_are_counted_and_none_are_not(
    granularity: str,
) -> None:
    """Layer-wise, the running sums of the parameters' gradients are the working set's: with
    ``.grad`` None at the call autograd takes them as ``.grad`` (a small weight's sum, kept
    transposed, is put in the weight's layout first); with ``.grad`` held (gradients
    accumulating) they are added into it, and both are held. Before, ``.grad`` was counted
    beside the sums always, and the held call was still over its budget (its first call
    2,732,178 bytes under 2,451,866): a copy of the transposed sum after the run was counted
    nowhere. A stack plan's step, too, holds its ``.grad`` beside the rest when it is held
    (``Revolve(1)`` on a 100-256-10 net: 113,704 bytes more, its ``.grad``; counted once,
    for both, before: 1.06x its budget)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 512), snn.Leaky(0.9), nn.Linear(512, 10), snn.Leaky(0.9))
    x = _input((30, 4, 512))
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())

    def peak(seq: nn.Module, held: bool) -> int:
        net.zero_grad(set_to_none=True)
        if held:  # gradients accumulating: .grad from an earlier call, counted in the step
            for p in net.parameters():
                p.grad = torch.zeros_like(p)
        with MemoryMeter() as meter:
            meter.track([x, *(p.grad for p in net.parameters() if p.grad is not None)])
            seq(x).sum().backward()
        return meter.peak_bytes

    def wrapped(budget: int) -> nn.Module:
        return spikeckpt.wrap(net, budget=budget, granularity=granularity, storage="disk")

    smallest = {}
    for held in (False, True):
        with pytest.raises(spikeckpt.BudgetTooSmall, match="smallest budget") as info:
            peak(wrapped(4096), held)
        smallest[held] = info.value.minimum_bytes
        for budget in (smallest[held], smallest[held] * 11 // 10):
            assert peak(wrapped(budget), held) <= budget, (held, budget)
    assert smallest[True] - smallest[False] >= 0.9 * grad_bytes
    # planned lean, then called with .grad held: planned again, and refused where it cannot
    seq = wrapped(smallest[False])
    assert peak(seq, False) <= smallest[False]
    with pytest.raises(spikeckpt.BudgetTooSmall, match="smallest budget"):
        peak(seq, True)


@pytest.mark.parametrize("factor", [1, 1.5, 2, 6])
def test_a_wide_layer_keeps_its_budget_past_the_gradient_sums(factor: float) -> None:
    """A wide ``Linear`` + fused ``Leaky`` (every block untaped): short chunks peak while
    the weight's gradient sums (1 MiB) are held, long ones while the chunk's buffers are,
    which grow about three times as fast per step. Chunks chosen from the short chunks'
    line held 1.41-1.56x the named smallest budget and twice it here, up to 2.04x the
    budget in the peers' benchmark at n = 512 on the CPU, 1.07x at n = 8192 on an H200."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 512), snn.Leaky(beta=0.95))
    generator = torch.Generator().manual_seed(0)
    x = SpikeTrain.from_dense((torch.rand(300, 16, 512, generator=generator) < 0.05).float())

    options: dict[str, Any] = dict(granularity="layer", readout="sum", weighted=False)
    budget = int(_named(net, x, **options) * factor)
    used, chunk = _first_call(net, x, budget, **options)
    assert chunk is not None and chunk > 8  # past the gradient sums' line
    assert used <= budget, (factor, budget, used, chunk)


def test_the_named_smallest_budget_of_a_deep_untaped_net_is_accepted_and_kept() -> None:
    """Three fused blocks, host storage: a probe held under the named smallest budget
    measures fewer chunk lengths than the refusal's own probe and counts the cost model's
    bytes per step past them; the named budget says so (was refused when passed back, once
    the probe measured past the gradient sums: 996,906 B named, 973.54 KiB "needed")."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(64, 128), snn.Leaky(beta=0.9),
        nn.Linear(128, 128), snn.Leaky(beta=0.9),
        nn.Linear(128, 5), snn.Leaky(beta=0.9),
    )  # fmt: skip
    x = _input((200, 8, 64))

    def peak(budget: int) -> int:
        seq = spikeckpt.wrap(net, budget=budget, granularity="layer", storage="host")
        net.zero_grad(set_to_none=True)
        with MemoryMeter() as meter:
            meter.track([x])
            out = seq(x)
            (out * torch.arange(1, out.shape[-1] + 1)).sum().backward()
            del out
        return meter.peak_bytes

    with pytest.raises(spikeckpt.BudgetTooSmall) as info:
        peak(4096)
    smallest = info.value.minimum_bytes
    assert peak(smallest) <= smallest


@pytest.mark.measured_gather_rule  # the library's own synapse rule, as the sweep ran it
def test_the_named_smallest_budget_is_checked_by_the_probes_a_call_under_it_runs() -> None:
    """The refusal's named budget, passed back, is accepted and kept: a probe held under it
    stops at the lengths its own limit allows, which can be fewer than the refusal counted
    (`Linear(128, 256)` + `Leaky` + `Linear(256, 10)` + `Leaky`, host tier: 618,628 B named,
    then refused naming the same; found by a randomized sweep)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(128, 256), snn.Leaky(beta=0.9), nn.Linear(256, 10), snn.Leaky(beta=0.95)
    )
    generator = torch.Generator().manual_seed(1)
    x = (torch.rand(100, 4, 128, generator=generator) < 0.1).float()

    def peak(budget: int) -> int:
        seq = spikeckpt.wrap(net, budget=budget, granularity="layer", readout="sum")
        net.zero_grad(set_to_none=True)
        with MemoryMeter() as meter:
            meter.track([x])
            (seq(x) * torch.arange(1, 11)).sum().backward()
        return meter.peak_bytes

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the case found: one thread (two run another synapse path)
    try:
        with pytest.raises(spikeckpt.BudgetTooSmall) as info:
            peak(4096)
        smallest = info.value.minimum_bytes
        assert peak(smallest) <= smallest
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fuse", [False, True])
def test_a_packed_input_s_first_call_keeps_the_budget_its_probes_run_under(fuse: bool) -> None:
    """The working-set probe runs a few samples of a packed input's first steps: each step
    was unpacked for the whole batch and sliced, the views holding every whole step (32
    steps of 32 KiB at batch 16): the first call held 1.80x a budget of 1.05x the named
    smallest (`Linear(512, 32)` + `Leaky`, ``fuse=False``; found by a randomized sweep)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 32), snn.Leaky(beta=0.9))
    generator = torch.Generator().manual_seed(1)
    x = SpikeTrain.from_dense((torch.rand(80, 16, 512, generator=generator) < 0.05).float())
    options: dict[str, Any] = dict(
        granularity="layer", storage="host", readout="sum", fuse=fuse, weighted=False
    )
    smallest = _named(net, x, **options)
    for factor in (1, 1.05, 1.5):
        budget = int(smallest * factor)
        assert _first_call(net, x, budget, **options)[0] <= budget, factor


@pytest.mark.parametrize("factor", [2, 3])
def test_a_taped_step_keeps_its_budget_past_the_turn_to_the_tape_s_line(factor: float) -> None:
    """Taped blocks (``fuse=False``), a packed input on disk: the whole batch's peak grows by
    36 KB per step up to chunk 4 (the gradient sums' line), 53 KB from 8 to 16 (the tape's),
    and two samples grow by 4.5 KB per step throughout (36 KB scaled): chunks chosen from
    those held 1.08x and 1.19x budgets of 2 and 3 times the named smallest (128-128-10,
    T = 50, batch 16; found by a randomized sweep). The whole batch is now measured at
    longer chunks, as for untaped blocks."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(128, 128), snn.Leaky(beta=0.9), nn.Linear(128, 10), snn.Leaky(beta=0.95)
    )
    generator = torch.Generator().manual_seed(1)
    x = SpikeTrain.from_dense((torch.rand(50, 16, 128, generator=generator) < 0.2).float())
    options: dict[str, Any] = dict(granularity="layer", storage="disk", readout="sum", fuse=False)
    budget = int(_named(net, x, **options) * factor)
    used, chunk = _first_call(net, x, budget, **options)
    assert chunk is not None and chunk > 4  # past the gradient sums' line
    assert used <= budget, (factor, budget, used, chunk)


def test_a_packed_input_s_named_smallest_counts_its_densest_chunk() -> None:
    """A chunk of one step reads the positions of its ones: the probe ran the input's first
    steps, and a denser step of the 80 held 448 B more than the named smallest budget
    (`Linear(512, 32)` + `Leaky`, 10% packed, disk, ``fuse=False``; the budget sweep's
    "narrow" case). The probes now run each length's densest chunk."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 32), snn.Leaky(beta=0.9))
    generator = torch.Generator().manual_seed(0)
    x = SpikeTrain.from_dense((torch.rand(80, 16, 512, generator=generator) < 0.1).float())

    options: dict[str, Any] = dict(granularity="layer", storage="disk", fuse=False)
    smallest = _named(net, x, **options)
    assert _first_call(net, x, smallest, **options)[0] <= smallest


def test_the_probe_cache_keeps_apart_models_that_return_more() -> None:
    """The probe and plan caches are the process's: keyed by the step's code and shapes, a
    spikes-only model's probe was used for a same-shaped model returning ``(spk, mem)`` (and
    for the same net wrapped with ``output="both"``): a refusal named 37,748 B where a fresh
    process names 49,364 (one ``(T, B, n)`` output and its gradient uncounted)."""
    from spikeckpt.engine import measure, planned

    def net(output: bool) -> nn.Module:
        torch.manual_seed(0)
        hidden = {"init_hidden": output}  # snnTorch's output=True needs init_hidden
        return nn.Sequential(
            nn.Linear(13, 11),
            snn.Leaky(0.9, **hidden),
            nn.Linear(11, 7),
            snn.Leaky(0.9, output=output, **hidden),
        )

    x = (torch.rand(60, 4, 13, generator=torch.Generator().manual_seed(0)) < 0.2).float()

    def smallest(model: nn.Module, **options: Any) -> int:
        with pytest.raises(spikeckpt.BudgetTooSmall) as info:
            spikeckpt.wrap(model, plan="auto", budget=4096, granularity="stack", **options)(x)
        return info.value.minimum_bytes

    spikes = smallest(net(False))
    after = [smallest(net(True), output=None), smallest(net(False), output="both")]
    measure._PROBES.clear()
    planned._SCHEDULES.clear()
    fresh = [smallest(net(True), output=None), smallest(net(False), output="both")]
    assert after == fresh and fresh[0] > spikes
