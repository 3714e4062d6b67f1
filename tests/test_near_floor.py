"""Issue 18 (performance near the recompute floor): what the faster paths must keep exact.

Fast snnTorch ``Leaky`` steps in layer-wise blocks (bitwise the adapter's), chunks grouped
into store entries (same results), saved bytes counted on sampled steps (ledger still equal to
the simulator), plans built without intervals filled from measurements (cached), the budget of
``plan="auto"`` holding the gradients too, and the budgeted layer-wise chunk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc
import spikeckpt.engine.planned as planned_module
import spikeckpt.engine.scan_budget as scan_budget
from spikeckpt import plans as P
from spikeckpt.engine.saved import measure_step
from spikeckpt.engine.tree import tree_flatten
from spikeckpt.models import LIFStack, spike_train
from spikeckpt.plans.intervals import TOLERANCE, fill, needs_intervals

snn = pytest.importorskip("snntorch")


def _snn_net(**leaky: Any) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(30, 24), snn.Leaky(beta=0.9, **leaky), nn.Linear(24, 5), snn.Leaky(beta=0.8)
    )
    with torch.no_grad():
        for layer in net[::2]:
            layer.weight.mul_(3.0)
    return net


def _run(seq: nn.Module, x: Tensor, net: nn.Module) -> tuple[Tensor, list[Tensor]]:
    net.zero_grad(set_to_none=True)
    y = seq(x)
    (y * torch.linspace(0.5, 1.5, y.numel()).reshape(y.shape)).sum().backward()
    return y.detach(), [p.grad.clone() for p in net.parameters() if p.grad is not None]


def _neurons(seq: nn.Module) -> list[Any]:
    """The snnTorch neuron adapters of a wrapped stack."""
    from spikeckpt.adapters.snntorch import SnnTorchNeuronAdapter

    return [a for a in seq.adapter.layers if isinstance(a, SnnTorchNeuronAdapter)]


@pytest.mark.parametrize(
    "leaky",
    [{}, {"reset_mechanism": "zero"}, {"learn_beta": True, "learn_threshold": True}],
    ids=["subtract", "zero", "learnable"],
)
@pytest.mark.parametrize("granularity", ["layer", "stack"])
def test_fast_leaky_steps_are_bitwise_the_adapters(leaky: dict[str, Any], granularity: str) -> None:
    net = _snn_net(**leaky)
    x = spike_train(40, 3, 30, 0.2)
    # fuse=False: the per-step path, where the fast step runs (fused chunks do not call it)
    options: dict[str, Any] = {"output": "both", "readout": None, "granularity": granularity}
    if granularity == "layer":
        options.update(chunk=7, fuse=False)
    else:
        options.update(plan=sc.plans.Uniform(7))
    fast = sc.wrap(net, **options)
    slow = sc.wrap(net, **options)
    for neuron in _neurons(slow):  # the modules' own calls
        neuron.fast_verified = False
    got = _run(lambda v: torch.cat(fast(v), -1), x, net)
    want = _run(lambda v: torch.cat(slow(v), -1), x, net)
    assert all(n.fast_verified for n in _neurons(fast))
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(g, w) for g, w in zip(got[1], want[1], strict=True))


def test_fast_leaky_falls_back_when_it_differs() -> None:
    from spikeckpt.adapters.snntorch_fast import same_results as _same_results

    net = _snn_net()
    neuron = _neurons(sc.wrap(net))[0]
    good = neuron._fast

    def off(state: Any, x: Tensor) -> Any:
        new, y = good(state, x)
        return new, y * 0.5

    assert _same_results(neuron.module_step, good, neuron)
    assert not _same_results(neuron.module_step, off, neuron)
    neuron._fast = off
    calls: list[int] = []
    net[1].register_forward_hook(lambda *args: calls.append(1))  # hooks run: the module's call
    state = neuron.init_state(torch.zeros(2, 24))
    neuron.step(state, torch.ones(2, 24))
    assert calls == [1] and neuron.fast_verified is None  # not even checked with a hook on


def test_sparse_first_synapse_equals_the_linear_on_sparse_and_dense_chunks() -> None:
    net = _snn_net()
    lin = net[0]
    block = sc.wrap(net, granularity="layer").layer_blocks(True)[0]
    assert block.sparse_synapse is not None
    sparse = spike_train(12, 3, 30, 0.03)
    assert float(sparse.mean()) <= 1 / 16  # conftest's pinned gather rule
    graded = sparse * torch.linspace(0.5, 2.0, 30)  # not binary: the values weigh the gather
    dense = spike_train(12, 3, 30, 0.5)
    weights = torch.linspace(-1.0, 1.0, 12 * 3 * 24).reshape(12, 3, 24)
    for x in (sparse, graded, torch.zeros(12, 3, 30)):
        got = block.sparse_synapse(x)
        torch.testing.assert_close(got, lin(x), rtol=1e-6, atol=1e-6)
        g_got = torch.autograd.grad((got * weights).sum(), [lin.weight, lin.bias])
        g_want = torch.autograd.grad((lin(x) * weights).sum(), [lin.weight, lin.bias])
        for a, b in zip(g_got, g_want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(block.sparse_synapse(dense), block.synapse(dense))  # the dense path
    needs = sparse.clone().requires_grad_()
    assert torch.equal(block.sparse_synapse(needs), block.synapse(needs))  # input grad: dense
    hidden = sc.wrap(net, granularity="layer").layer_blocks(True)
    assert all(b.sparse_synapse is not None for b in hidden)


@pytest.mark.parametrize("x_grad", [False, True])
def test_sparse_first_synapse_keeps_layerwise_gradients(x_grad: bool) -> None:
    # sparse chunks gather, dense ones multiply; x needing a gradient takes the dense path
    net = _snn_net()
    x = torch.cat([spike_train(30, 3, 30, 0.03), spike_train(30, 3, 30, 0.4, seed=2)])
    xr = x.clone().requires_grad_(x_grad)
    net.zero_grad(set_to_none=True)
    mems = [torch.zeros(3, 24), torch.zeros(3, 5)]
    total = torch.zeros(3, 5)
    for t in range(x.shape[0]):
        h, mems[0] = net[1](net[0](xr[t]), mems[0])
        h, mems[1] = net[3](net[2](h), mems[1])
        total = total + h * (1 + t / 60)
    total.square().sum().backward()
    want = [p.grad.clone() for p in net.parameters()]
    want_x = xr.grad
    seq = sc.wrap(net, granularity="layer", chunk=7, readout=None)
    net.zero_grad(set_to_none=True)
    xl = x.clone().requires_grad_(x_grad)
    ys = seq(xl)
    (ys * (1 + torch.arange(60.0) / 60)[:, None, None]).sum(0).square().sum().backward()
    for p, w in zip(net.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-5 * max(1.0, float(w.abs().max())))
    if x_grad:
        scale = max(1.0, float(want_x.abs().max()))
        torch.testing.assert_close(xl.grad, want_x, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("storage", ["host", "disk"])
def test_grouped_store_entries_change_nothing(storage: str, tmp_path: Path) -> None:
    net = _snn_net()
    x = spike_train(50, 3, 30, 0.2)
    folder = {"directory": tmp_path} if storage == "disk" else {}  # only the disk tier takes one
    seq = sc.wrap(net, granularity="layer", chunk=4, storage=storage, **folder)
    blocks = seq.layer_blocks(True)
    results = []
    for group in (1, 3, None):
        net.zero_grad(set_to_none=True)
        state = seq.block_states(seq.adapter.init_state(x[0]))
        out = sc.engine.layerwise.layerwise_scan(
            blocks, x, state, chunk=4, storage=storage, readout="sum", group=group, **folder,
        )  # fmt: skip
        ys, stats = out.ys, out.stats
        (ys * torch.arange(1.0, 6.0)).sum().backward()
        results.append((ys.detach(), [p.grad.clone() for p in net.parameters()]))
        assert stats.completed and stats.storage_ledger.current.get(storage, 0) == 0
    for ys, grads in results[1:]:
        assert torch.equal(ys, results[0][0])
        assert all(torch.equal(g, w) for g, w in zip(grads, results[0][1], strict=True))
    assert not list(tmp_path.rglob("*.*"))


def test_sampled_tape_bytes_match_counting_every_step() -> None:
    net = LIFStack((12, 16, 4))
    x = spike_train(30, 2, 12, 0.3)
    state = tuple((v.requires_grad_(), s) for v, s in net.initial_state(2))
    out = sc.scan(net.step, x, state, plan=P.Uniform(7), readout="sum")
    ys, stats = out.ys, out.stats
    ys.sum().backward()
    probe = measure_step(net.step, state, x[0], list(net.parameters()))
    assert stats.tape_bytes_per_step == probe.step_bytes
    predicted = P.simulate(
        stats.schedule, state_bytes=probe.state_bytes, step_bytes=probe.step_bytes
    )
    assert stats.peak_bytes["device"] == predicted.peak_bytes


def test_nested_states_round_trip_through_the_fast_tree() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "v s")
    obj = (Pair(torch.ones(2), (torch.zeros(1),)), [torch.ones(3)])
    leaves, tree = tree_flatten(obj)
    assert tree.kind == "nested" and tree.names == ["[0].v", "[0].s[0]", "[1][0]"]
    assert tree.unflatten(leaves) == obj or repr(tree.unflatten(leaves)) == repr(obj)
    assert tree.flatten(((torch.ones(2), (torch.zeros(1),)), [torch.ones(3)])) is None
    assert tree.flatten((Pair(torch.ones(2), (torch.zeros(1),)), [1.0])) is None


# ----------------------------------------------------------------------------- intervals


def test_fill_rules() -> None:
    S, A, T = 34_000, 50_000, 1000
    cheap = P.CostModel(forward=1.0, backward=1.65, write=0.5, read=0.5, segment=1.0)
    assert needs_intervals(P.Double()) and needs_intervals(P.Double(64))
    assert needs_intervals(P.Uniform()) and needs_intervals(P.TwoLevel(4))
    assert not needs_intervals(P.Uniform(5)) and not needs_intervals(P.Revolve(4))
    assert not needs_intervals(P.TwoLevel(4, write_cost=1.0))
    double = fill(P.Double(), T, state_bytes=S, step_bytes=A, costs=cheap)
    cost = double.cost(T, state_bytes=S, step_bytes=A, costs=cheap)
    assert cost.forward_steps / T <= 2.0  # the memory-only default pays about 3
    assert cost.time <= T * (2 * cheap.forward + cheap.backward) * (1 + TOLERANCE)
    uniform = fill(P.Uniform(), T, state_bytes=S, step_bytes=A, costs=cheap)
    assert cost.peak_bytes < uniform.cost(T, state_bytes=S, step_bytes=A).peak_bytes
    two = fill(P.TwoLevel(4), T, state_bytes=S, step_bytes=A, costs=cheap)
    assert (two.write_cost, two.read_cost, two.backward_cost) == (0.5, 0.5, 1.65)
    assert fill(P.Revolve(4), T, state_bytes=S, step_bytes=A, costs=cheap) == P.Revolve(4)
    # no measured times: sizes alone fill Uniform; Double keeps its own default
    assert fill(P.Double(), T, state_bytes=S, step_bytes=A, costs=None) == P.Double().for_length(T)


def test_scan_fills_intervals_once_per_step_and_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    net = LIFStack((12, 16, 4))
    x = spike_train(60, 2, 12, 0.3)
    calls = []
    real = scan_budget.probe_step

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(scan_budget, "probe_step", counting)
    planned_module._PLANNED.clear()
    grads = []
    for _ in range(2):
        net.zero_grad(set_to_none=True)
        out = sc.scan(
            net.step, x, net.initial_state(2), plan=P.Double(), storage="host", readout="sum",
        )  # fmt: skip
        ys, stats = out.ys, out.stats
        ys.sum().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    assert len(calls) == 1
    assert stats.plan.startswith("Double(remote_interval=") and "None" not in stats.plan
    net.zero_grad(set_to_none=True)
    ys, _ = sc.scan(net.step, x, net.initial_state(2), plan=P.BPTT(), readout="sum")
    ys.sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads[0], net.parameters(), strict=True))


def test_auto_budget_holds_the_gradients() -> None:
    net = LIFStack((12, 16, 4))
    T = 200
    x = spike_train(T, 2, 12, 0.3)
    state = net.initial_state(2)
    probe = measure_step(net.step, state, x[0], [*net.parameters(), x])
    # the budget counts the whole step: the input, the gradients and the plan's activations
    with pytest.raises(sc.BudgetTooSmall, match="gradients") as least:
        sc.scan(net.step, x, state, plan="auto", budget=1, readout="sum")
    budget = least.value.minimum_bytes + 12 * probe.state_bytes + 10 * probe.step_bytes
    out = sc.scan(net.step, x, state, plan="auto", budget=budget, readout="sum")
    ys, stats = out.ys, out.stats
    ys.sum().backward()
    reserve = stats.planned.input + stats.planned.gradients  # what the plan's peak must leave
    assert stats.planned.gradients > 0
    assert stats.predicted.peak_bytes <= budget - reserve


def test_layer_granularity_with_a_budget_takes_the_largest_chunk_that_fits() -> None:
    net = _snn_net()
    x = spike_train(120, 4, 30, 0.2)
    with pytest.raises(sc.BudgetTooSmall) as info:
        sc.wrap(net, plan="auto", budget=1_000, granularity="layer")(x)
    smallest = info.value.minimum_bytes
    small = sc.wrap(net, plan="auto", budget=smallest, granularity="layer", storage="disk")
    large = sc.wrap(net, plan="auto", budget=4 * smallest, granularity="layer", storage="disk")
    small(x).sum().backward()
    large(x).sum().backward()
    assert 1 <= small.last_stats.chunk < large.last_stats.chunk <= 120
