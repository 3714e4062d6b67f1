"""Layer-wise granularity (``spikeckpt.engine.layerwise``, ``wrap(..., granularity="layer")``):
outputs and gradients against the plain time loop, packed spike storage, stats, errors, cleanup."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snn_loops import leaky_loop
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.adapters.layered import layer_blocks
from spikeckpt.adapters.registry import adapter_for
from spikeckpt.adapters.sequential import split_blocks
from spikeckpt.engine.layerwise import layerwise_scan
from spikeckpt.engine.stats import LayerwiseStats
from spikeckpt.errors import BudgetTooSmall, UnsupportedLayerError
from spikeckpt.planning import block_sizes, budgeted
from spikeckpt.planning.granularity import chunk_for
from spikeckpt.plans import BPTT, Double, Revolve, Uniform
from spikeckpt.plans.layerwise import layerwise_cost

snn = pytest.importorskip("snntorch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    nt = pytest.importorskip("norse.torch")

N_IN = 10


def _neuron(kind: str, i: int, n: int) -> nn.Module:
    if kind == "leaky":
        return snn.Leaky(beta=0.9 - 0.05 * i, learn_beta=i % 2 == 0)
    if kind == "synaptic":
        return snn.Synaptic(alpha=0.8, beta=0.9, init_hidden=i % 2 == 1)
    if kind == "lif":
        return nt.LIFCell()
    if kind == "lifrec":  # recurrence inside the block
        return nt.LIFRecurrentCell(n, n)
    raise AssertionError(kind)


def make_net(kinds: list[str], seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = N_IN
    for i, kind in enumerate(kinds):
        out = 7 - i
        lin = nn.Linear(width, out)
        # enough drive for spikes in every block, without saturating
        lo, hi = (-0.5, 0.8) if kind in ("leaky", "synaptic") else (-2.0, 6.0)
        nn.init.uniform_(lin.weight, lo, hi)
        layers += [lin, _neuron(kind, i, out)]
        width = out
    return nn.Sequential(*layers)


def spikes(T: int, B: int, n: int, density: float, seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    if density in (0.0, 1.0):
        return torch.full((T, B, n), density)
    return (torch.rand(T, B, n, generator=g) < density).float()


def plain_loop(model: nn.Module, x: Tensor, state: Any = None) -> tuple[Tensor, Tensor, Any]:
    """The reference: every layer stepped in order at every step, taped by autograd."""
    adapter = adapter_for(model)
    s = adapter.init_state(x[0]) if state is None else state
    ys, mems = [], []
    for t in range(x.shape[0]):
        s, y = adapter.step(s, x[t])
        ys.append(y)
        mems.append(adapter.membrane(s))
    adapter.cleanup()
    return torch.stack(ys), torch.stack(mems), s


def loss_of(ys: Tensor) -> Tensor:
    w = torch.linspace(0.5, 1.5, ys.shape[0]).reshape(-1, *([1] * (ys.dim() - 1)))
    return (ys * w).sum()


def close(a: Tensor | None, b: Tensor | None) -> None:
    if a is None or b is None:
        assert (a is None or not a.any()) and (b is None or not b.any())
        return
    scale = max(1.0, float(b.detach().abs().max()))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)


FRAMEWORKS = {
    "snntorch": ["leaky", "synaptic"],
    "norse": ["lif", "lifrec"],
}


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    framework=st.sampled_from(sorted(FRAMEWORKS)),
    n_blocks=st.integers(1, 4),
    pick=st.lists(st.integers(0, 1), min_size=4, max_size=4),
    T=st.sampled_from([1, 5, 7, 9]),
    chunk=st.sampled_from([1, 2, 3, 50]),
    storage=st.sampled_from(["host", "disk"]),
    density=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    x_grad=st.booleans(),
)
def test_layerwise_matches_the_plain_loop(
    framework: str,
    n_blocks: int,
    pick: list[int],
    T: int,
    chunk: int,
    storage: str,
    density: float,
    x_grad: bool,
    tmp_path: Path,
) -> None:
    kinds = [FRAMEWORKS[framework][p] for p in pick[:n_blocks]]
    model = make_net(kinds)
    x = spikes(T, 3, N_IN, density)
    params = list(model.parameters())

    xr = x.clone().requires_grad_(x_grad)
    ys_ref, _, _ = plain_loop(model, xr)
    wrt = params + ([xr] if x_grad else [])
    g_ref = torch.autograd.grad(loss_of(ys_ref), wrt, allow_unused=True)

    where = {"directory": tmp_path} if storage == "disk" else {}
    seq = sc.wrap(model, granularity="layer", chunk=chunk, storage=storage, **where)
    xl = x.clone().requires_grad_(x_grad)
    ys = seq(xl)
    assert isinstance(seq.last_stats, LayerwiseStats)
    assert seq.last_stats.chunk == min(chunk, T)
    close(ys, ys_ref)
    g = torch.autograd.grad(loss_of(ys), params + ([xl] if x_grad else []), allow_unused=True)
    for a, b in zip(g, g_ref, strict=True):
        close(a, b)
    assert seq.last_stats.completed
    assert seq.last_stats.storage_ledger.current.get(storage, 0) == 0
    assert seq.last_stats.blocks[0].density == pytest.approx(float(x.mean()))
    assert not list(tmp_path.iterdir())  # disk files removed after backward


@pytest.mark.parametrize("readout", [None, "sum", "mean", "last"])
@pytest.mark.parametrize("output", ["spikes", "mem", "both"])
def test_readouts_outputs_and_state_gradients(readout: str | None, output: str) -> None:
    model = make_net(["leaky", "synaptic", "leaky"])
    T = 7
    x = spikes(T, 2, N_IN, 0.5)
    adapter = adapter_for(model)
    blocks = layer_blocks(split_blocks(adapter))
    init = adapter.init_state(x[0])
    leaf = init[1].mem.clone().uniform_(0, 0.5).requires_grad_()
    states = [init[1]._replace(mem=leaf), init[3], init[5]]

    full = list(init)
    full[1] = states[0]
    spk, mem, final = plain_loop(model, x, tuple(full))
    per = {"spikes": spk, "mem": mem, "both": (spk, mem)}[output]

    def reduce(y: Tensor) -> Tensor:
        if readout is None:
            return y
        if readout == "last":
            return y[-1]
        return y.sum(0) / (T if readout == "mean" else 1)

    def loss(y: Any, fin: Any) -> Tensor:
        ys = y if isinstance(y, tuple) else (y,)
        return sum((loss_of(v) for v in ys), torch.zeros(())) + fin.mem.square().sum()

    ref = tuple(reduce(v) for v in per) if output == "both" else reduce(per)
    params = list(model.parameters())
    g_ref = torch.autograd.grad(loss(ref, final[-1]), [leaf, *params], allow_unused=True)

    ys, finals = layerwise_scan(blocks, x, states, chunk=3, readout=readout, output=output)
    if output == "both":
        for a, b in zip(ys, ref, strict=True):
            close(a, b)
    else:
        close(ys, ref)
    close(finals[-1].mem, final[-1].mem)
    g = torch.autograd.grad(loss(ys, finals[-1]), [leaf, *params], allow_unused=True)
    for a, b in zip(g, g_ref, strict=True):
        close(a, b)


def test_packed_spike_store_is_at_most_a_thirtieth_of_dense_at_5_percent() -> None:
    n, T, B = 256, 40, 16
    lin = nn.Linear(n, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(3 * torch.eye(n))  # block 0 passes its input spikes on unchanged
    model = nn.Sequential(lin, snn.Leaky(beta=0.0), nn.Linear(n, 4), snn.Leaky(beta=0.9))
    x = spikes(T, B, n, 0.05)
    for storage in ("host", "disk"):
        seq = sc.wrap(model, granularity="layer", chunk=8, storage=storage)
        ys = seq(x)
        st_ = seq.last_stats.blocks[1]
        assert st_.density == pytest.approx(float(x.mean()))
        assert st_.dense_bytes == T * B * n * 4
        assert 0 < st_.stored_bytes <= st_.dense_bytes / 30
        assert st_.saved_bytes == st_.dense_bytes - st_.stored_bytes
        assert set(st_.codecs) <= {"index", "bitpack"}
        ys.sum().backward()


def test_dropout_replays_exactly() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(N_IN, 8), nn.Dropout(0.3), snn.Leaky(beta=0.9))
    model.train()
    x = spikes(9, 2, N_IN, 0.5)
    torch.manual_seed(11)
    seq = sc.wrap(model, granularity="layer", chunk=4)
    ys = seq(x)
    g = torch.autograd.grad(loss_of(ys), list(model.parameters()))
    # reference: the same chunk-batched computation taped by autograd, same RNG stream
    torch.manual_seed(11)
    lin, drop, leaky = model
    mem = torch.zeros(2, 8)
    outs = []
    for t0 in range(0, 9, 4):
        xc = x[t0 : t0 + 4]
        z = drop(lin(xc.reshape(-1, N_IN))).reshape(xc.shape[0], 2, 8)
        for t in range(xc.shape[0]):
            s, mem = leaky(z[t], mem)
            outs.append(s)
    ref = torch.stack(outs)
    g_ref = torch.autograd.grad(loss_of(ref), list(model.parameters()))
    torch.testing.assert_close(ys, ref)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_chunk_from_plans() -> None:
    assert chunk_for(Uniform(4), 10) == 4
    assert chunk_for(Double(remote_interval=6, local_interval=3), 10) == 3
    assert chunk_for(None, 10) == 4 and chunk_for("auto", 100) == 10
    assert chunk_for(50, 7) == 7
    model = make_net(["leaky"])
    seq = sc.wrap(model, plan=Uniform(3), granularity="layer")
    seq(spikes(8, 2, N_IN, 0.5))
    assert seq.last_stats.chunk == 3 and seq.last_stats.n_chunks == 3


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (lambda: nn.Sequential(nn.Linear(4, 4), nn.Sequential(snn.Leaky(beta=0.9))), "nested"),
        (lambda: nn.Sequential(nn.Linear(4, 4), snn.Leaky(beta=0.9), nn.Linear(4, 2)), "ends"),
        (lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "no stateful"),
        (lambda: nn.Linear(4, 4), "no state"),
    ],
)
def test_non_block_models_asked_for_layer_raise(model: Any, why: str) -> None:
    with pytest.raises(UnsupportedLayerError, match="feed-forward") as err:
        sc.wrap(model(), granularity="layer")
    assert why in str(err.value)
    sc.wrap(model(), granularity="auto")  # auto falls back to stack
    sc.wrap(model(), granularity="stack")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="granularity"):
        sc.wrap(make_net(["leaky"]), granularity="block")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="callable readout"):  # refused at wrap time
        sc.wrap(make_net(["leaky"]), granularity="layer", readout=lambda a, y, t: y)


def _three_blocks() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(100, 64), snn.Leaky(beta=0.9), nn.Linear(64, 64), snn.Leaky(beta=0.9),
        nn.Linear(64, 10), snn.Leaky(beta=0.9),
    )  # fmt: skip
    with torch.no_grad():
        for layer in net[::2]:
            layer.weight.mul_(3.0)
    return net


def test_auto_picks_layer_wise_within_the_stack_plans_memory_for_spikes_and_currents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without a budget the stack plan is the CPU default, Uniform(ceil(sqrt(T))) = Uniform(15);
    # layer-wise runs when its modeled step fits that plan's and its measured time is not
    # slower: the largest such chunk, in about the stack plan's memory. The memory is what is
    # tested: the times are let through (on a loaded machine the two measured times crossed
    # in 5 of 16 runs, and the stack ran)
    monkeypatch.setattr(budgeted, "LAYERWISE_TIME_TOLERANCE", 1e9)
    net = _three_blocks()
    x = spikes(200, 8, 100, 0.1)
    seq, stack = sc.wrap(net, granularity="auto"), sc.wrap(net, plan=Uniform(15))
    for model in (seq, stack):
        loss_of(model(x)).backward()  # the first call probes and plans
    with sc.MemoryMeter() as layer_meter:
        loss_of(seq(x)).backward()
    assert isinstance(seq.last_stats, LayerwiseStats)
    assert seq.last_stats.chunk >= 15
    with sc.MemoryMeter() as stack_meter:
        loss_of(stack(x)).backward()
    # the layer-wise step is modeled within the stack plan's modeled step, which counts more
    # than it holds here (527 KB modeled beside the input, 360 KB measured): chunk 36 holds
    # 1.12x the stack's measured peak (chunk 31, 1.04x, while layer-wise counted `.grad`
    # beside the gradient sums that become it)
    assert layer_meter.peak_bytes <= 1.15 * stack_meter.peak_bytes
    # input currents, not spikes: weighed the same way (layer-wise keeps the blocks' spikes,
    # and a reference to the input), within the stack plan's memory, the loop's outputs
    currents = x * torch.rand(x.shape[-1]) + 0.5
    want = sc.wrap(net, plan=BPTT())(currents)
    got = seq(currents)  # the first call probes and plans
    loss_of(stack(currents)).backward()
    assert isinstance(seq.last_stats, LayerwiseStats)
    torch.testing.assert_close(got, want)
    with sc.MemoryMeter() as layer_meter:
        loss_of(seq(currents)).backward()
    with sc.MemoryMeter() as stack_meter:
        loss_of(stack(currents)).backward()
    assert layer_meter.peak_bytes <= 1.15 * stack_meter.peak_bytes


def test_auto_runs_calls_without_autograd_layer_wise_once_training_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # validation under torch.no_grad() always ran the stack's plain loop (0.84-1.19x the
    # loop's time, where layer-wise took 0.49-0.70x), also after training ran layer-wise
    monkeypatch.setattr(budgeted, "LAYERWISE_TIME_TOLERANCE", 1e9)
    net = _three_blocks()
    x = spikes(200, 8, 100, 0.1)
    seq = sc.wrap(net, granularity="auto")
    with torch.no_grad():  # before any training call: the stack (nothing measured yet)
        want = seq(x[:50])
    assert not isinstance(seq.last_stats, LayerwiseStats)
    loss_of(seq(x)).backward()
    assert isinstance(seq.last_stats, LayerwiseStats)
    with torch.no_grad():
        got = seq(x[:50])  # another length, untaped: layer-wise, no probe
    assert isinstance(seq.last_stats, LayerwiseStats)
    torch.testing.assert_close(got, want)


def test_auto_keeps_the_stack_when_its_plan_models_less_memory() -> None:
    # Revolve(2) keeps two states and one taped step; layer-wise tapes a 15-step chunk
    seq = sc.wrap(_three_blocks(), plan=Revolve(2), granularity="auto")
    seq(spikes(200, 8, 100, 0.1))
    assert not isinstance(seq.last_stats, LayerwiseStats)
    assert seq._auto_chunks == {(200, 8): None}


def test_auto_without_a_budget_runs_layerwise_near_the_default_plans_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``plan="auto"`` without a budget: the stack plan's memory is a yardstick, not a limit
    the user set. Norse's ``Linear-LIFCell-Linear-LICell`` (T = 200, batch 8; a ``"tanh"``
    spike, whose kernel keeps the whole chunk for its backward: Norse's default ``"super"``
    keeps a third of it, and its chunks fit): no layer-wise chunk fits ``Uniform(15)``'s
    modeled step, so ``granularity="auto"`` ran the stack (0.77 s against 0.33 s layer-wise,
    measured with ``"super"`` then); its least layer-wise step is within
    `LAYERWISE_MEMORY_SLACK` of it, and it now runs that, in at most that much more measured
    memory than the stack's run, gradients at round-off of the stack's. The same plan given
    (``plan=Uniform(15)``) keeps its memory as the limit: the stack. The time rule is taken
    out here (any time passes): under load the measured chunks' times decide otherwise."""
    from spikeckpt.planning.granularity import LAYERWISE_MEMORY_SLACK

    monkeypatch.setattr(budgeted, "LAYERWISE_TIME_TOLERANCE", 1e9)
    torch.manual_seed(0)
    cell = nt.LIFCell(nt.LIFParameters(method="tanh"))
    net = nt.SequentialState(nn.Linear(100, 64), cell, nn.Linear(64, 10), nt.LICell())
    x = spikes(200, 8, 100, 0.05)
    runs = []
    for granularity, plan in (("stack", "auto"), ("auto", "auto"), ("auto", Uniform(15))):
        seq = sc.wrap(net, granularity=granularity, plan=plan)
        seq(x)  # planned (its probes are not the step's peak)
        net.zero_grad()
        with sc.MemoryMeter() as meter:
            meter.track([x])
            loss_of(seq(x)[0]).backward()
        grads = [p.grad.clone() for p in net.parameters()]
        runs.append((seq.last_decision, meter.peak_bytes, grads))
    (stack, stack_peak, want), (auto, auto_peak, got), (given, _, _) = runs
    assert stack.granularity == "stack" and auto.granularity == "layer"
    assert given.granularity == "stack" and given.plan == stack.plan
    assert auto_peak <= LAYERWISE_MEMORY_SLACK * stack_peak
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_auto_with_a_budget_keeps_to_it_and_runs_layerwise_where_only_it_fits() -> None:
    # 20 kB fits neither; the refusal's smallest budget (the dense input, outputs, gradient
    # buffers and .grad counted) fits layer-wise chunks of one step only: 2T evaluations per
    # block; at twice that budget a stack plan is modeled faster. A batch of 32: at 8 the
    # parameters' gradient sums (which layer-wise holds for every block at once) outweigh
    # what one block's tape saves over the stack's whole step, and the stack fits first
    x = spikes(200, 32, 100, 0.1)
    with pytest.raises(BudgetTooSmall) as info:
        sc.wrap(_three_blocks(), plan="auto", budget=20_000, granularity="auto", storage="disk")(x)
    smallest = info.value.minimum_bytes
    for budget in (smallest, 2 * smallest):
        seq = sc.wrap(
            _three_blocks(), plan="auto", budget=budget, granularity="auto", storage="disk"
        )
        with sc.MemoryMeter() as meter:
            meter.track([x])
            loss_of(seq(x)).backward()
        assert meter.peak_bytes <= budget
        stats = seq.last_stats
        if budget == smallest:
            assert isinstance(stats, LayerwiseStats) and stats.chunk == 1
            assert stats.forward_steps == 2 * 200 * 3


@pytest.mark.parametrize("chunk", [5, 15, 40])
def test_modeled_layerwise_peak_is_close_to_the_measured_one(chunk: int) -> None:
    net = _three_blocks()
    x = spikes(200, 8, 100, 0.1)
    seq = sc.wrap(net, granularity="layer", chunk=chunk, storage="disk", readout="sum")
    state = seq.adapter.init_state(x[0])
    sizes = block_sizes(seq.layer_blocks(True), x[0], seq.block_states(state))
    assert [s.density for s in sizes][0] == pytest.approx(0.1, abs=0.05)
    modeled = layerwise_cost(200, chunk, sizes).peak_bytes
    with sc.MemoryMeter() as meter:
        seq(x).sum().backward()
    grads = sum(p.numel() * p.element_size() for p in net.parameters())
    # the model counts a taped step's bytes (A_b); blocks whose affine synapse feeds a fused
    # neuron run their backward untaped and hold less (measured 0.55-0.66 of the model here)
    assert 0.5 <= (meter.peak_bytes - grads) / modeled <= 1.3


def test_batch_first_and_return_state_match_stack_mode() -> None:
    model = make_net(["lif", "lifrec"])
    x = spikes(2, 6, N_IN, 0.4).transpose(0, 1).contiguous()  # (B, T, N) with batch_first
    stack = sc.wrap(model, batch_first=True)
    layer = sc.wrap(model, batch_first=True, granularity="layer", chunk=4)
    ys_s, st_s = stack(x, return_state=True)
    ys_l, st_l = layer(x, return_state=True)
    close(ys_l, ys_s)
    assert len(st_l) == len(st_s) and st_l[0] == () and st_l[2] == ()
    close(st_l[3].v, st_s[3].v)


def test_disk_files_go_when_outputs_are_dropped_and_second_backward_fails(
    tmp_path: Path,
) -> None:
    model = make_net(["leaky", "leaky"])
    x = spikes(9, 2, N_IN, 0.5)
    seq = sc.wrap(model, granularity="layer", chunk=2, storage="disk", directory=tmp_path)
    ys = seq(x)
    assert list(tmp_path.iterdir())  # the store's folder exists while the graph lives
    del ys
    gc.collect()
    assert not list(tmp_path.iterdir())
    ys = seq(x)
    ys.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        ys.sum().backward()
    with torch.no_grad():  # no graph: nothing stored at all
        seq(x)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("options", [{}, {"exact": True}, {"fuse": False}])
def test_a_neuron_whose_input_arrives_a_step_late_leaves_grad_none_at_t_1(
    options: dict[str, Any],
) -> None:
    """Norse's LSNN spikes at step 0 from its initial state alone: over T = 1 the loop gives
    the layers below no gradient (``.grad`` None); the fused kernel gave zeros, which AdamW's
    weight decay then applied (0.0119 on the input weights)."""
    norse = pytest.importorskip("norse.torch")
    import copy

    torch.manual_seed(0)
    base = norse.SequentialState(
        nn.Linear(6, 8), norse.LSNNRecurrentCell(8, 8), nn.Linear(8, 4), norse.LICell()
    )
    x = (torch.rand(1, 3, 6) < 0.6).float()
    loop = copy.deepcopy(base)
    z, _ = loop(x[0], None)
    z.pow(2).sum().backward()
    net = copy.deepcopy(base)
    out, _ = sc.wrap(net, granularity="layer", **options)(x)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out[0], z)
    for (name, a), b in zip(loop.named_parameters(), net.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, msg=name)


@pytest.mark.parametrize("where", ["one block", "two blocks"])
def test_a_batchnorm_at_two_positions_is_refused_layerwise(where: str) -> None:
    """A BatchNorm tracking running statistics at two positions: layer-wise calls them in
    another order than the loop (a chunk of steps at one, then at the other), so the running
    mean came out 0.025 apart, silently (helper h20). ``granularity="layer"`` refuses it,
    naming both positions and the stack; ``"auto"`` runs the stack: running statistics
    bitwise the loop's."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(16)
    if where == "one block":
        layers = [nn.Linear(20, 16), bn, nn.Linear(16, 16), bn]
    else:
        layers = [nn.Linear(20, 16), bn, snn.Leaky(beta=0.9, init_hidden=True)]
        layers += [nn.Linear(16, 16), bn]
    net = nn.Sequential(*layers, snn.Leaky(beta=0.9, init_hidden=True, output=True))
    start = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.rand(6, 5, 20)
    from snntorch import utils

    utils.reset(net)
    for x_t in x:
        net(x_t)
    want = bn.running_mean.clone()
    net.load_state_dict(start)
    with pytest.raises(UnsupportedLayerError, match="also runs at '1'.*granularity='stack'"):
        sc.wrap(net, granularity="layer")(x)
    seq = sc.wrap(net, granularity="auto")
    seq(x)
    assert seq.last_decision.granularity == "stack"
    assert torch.equal(bn.running_mean, want)


def _dropout_net(blocks: int) -> nn.Sequential:
    """Linear -> Leaky [-> Dropout] per layer, Dropout after the first ``blocks`` neurons."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate([(8, 16), (16, 16), (16, 4)]):
        layers += [nn.Linear(n_in, n_out), snn.Leaky(beta=0.9, threshold=0.3)]
        if i < blocks:
            layers.append(nn.Dropout(0.3))
    return nn.Sequential(*layers)


@pytest.mark.usefixtures("quiet_costs")  # "auto" picks layer-wise by measured times
@pytest.mark.parametrize("granularity", ["layer", "auto", "stack"])
def test_dropout_in_two_blocks_run_layerwise_warns_once(granularity: str) -> None:
    """Dropout after two neurons: a layer-wise run draws each block's masks for a chunk of
    steps before the next block's, so it used other masks than the plain loop under the same
    seed (gradients 0.5-1.5 relative off the loop's on helper h28's N-MNIST net), silently,
    also where ``granularity="auto"`` chose it. It now warns once per wrapped model, naming
    the Dropouts and ``granularity='stack'``, which draws the loop's masks (checked here)."""
    x = (torch.rand(30, 3, 8, generator=torch.Generator().manual_seed(1)) < 0.3).float()
    loop = _dropout_net(2)
    torch.manual_seed(5)
    leaky_loop(loop, x)[0].sum().backward()
    net = _dropout_net(2)
    seq = sc.wrap(net, granularity=granularity, readout="sum")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(5)
        seq(x).sum().backward()
        seq(x).sum()
    said = [str(w.message) for w in caught if "Dropout in 2 blocks" in str(w.message)]
    if granularity == "stack":
        assert said == []
        for a, b in zip(loop.parameters(), net.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
        return
    assert seq.last_decision is not None and seq.last_decision.granularity == "layer"
    assert len(said) == 1, said  # once per wrapped model
    assert "('2', '5')" in said[0] and "granularity='stack'" in said[0]
    assert ("'auto' chose layer-wise" in said[0]) == (granularity == "auto")
    net.eval()  # no draws: no warning from a fresh wrap either
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sc.wrap(net, granularity=granularity, readout="sum")(x)
    assert not [w for w in caught if "Dropout in" in str(w.message)]


def test_dropout_in_one_block_layerwise_draws_the_loops_masks_without_a_warning() -> None:
    """One block drawing: layer-wise draws its masks in the loop's order, so its gradients
    are the loop's and nothing is warned."""
    x = (torch.rand(30, 3, 8, generator=torch.Generator().manual_seed(1)) < 0.3).float()
    loop = _dropout_net(1)
    torch.manual_seed(5)
    leaky_loop(loop, x)[0].sum().backward()
    net = _dropout_net(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(5)
        sc.wrap(net, granularity="layer", chunk=7, readout="sum")(x).sum().backward()
    assert not [w for w in caught if "Dropout in" in str(w.message)]
    for a, b in zip(loop.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
