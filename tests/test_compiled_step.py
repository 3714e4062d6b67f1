"""The stack granularity's compiled step (``compile=True``, `spikeckpt.engine.compiled_step`):
bitwise the eager step on every plan, Dropout and BatchNorm included, and eager with one line
where it cannot compile."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import snntorch as snn
import torch
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.engine import compiled, compiled_step

pytestmark = [
    pytest.mark.slow,  # each new step compiles for a few seconds
    pytest.mark.skipif(
        compiled.compiler_missing("cpu") is not None, reason="no C++ compiler for inductor"
    ),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test compiles afresh: dynamo keeps at most ``recompile_limit`` (8) entries per code
    object (here the wrapper's ``step``) and runs the rest eagerly."""
    torch._dynamo.reset()


PLANS = [
    sc.plans.BPTT(),
    sc.plans.Uniform(interval=3),
    sc.plans.Revolve(slots=2),
    sc.plans.Double(remote_interval=4, local_interval=2),
]


def _step(seq: nn.Module, net: nn.Module, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """One training step: the output and every parameter's gradient."""
    net.zero_grad(set_to_none=True)
    out = seq(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), [p.grad.clone() for p in net.parameters() if p.grad is not None]


def _same(
    a: tuple[Tensor, list[Tensor]], b: tuple[Tensor, list[Tensor]], bitwise: bool = True
) -> None:
    """Outputs bitwise; gradients bitwise, or within float32 round-off of the largest."""
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1])
    scale = max(float(g.abs().max()) for g in a[1])
    for x, y in zip(a[1], b[1], strict=True):
        if bitwise:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6 * scale)


def _both(net: nn.Module, x: Tensor, plans: list[Any], bitwise: bool = True) -> None:
    """Every plan through one eager and one compiled wrapper: the same (`_same`), and the
    compiled one said it ran compiled."""
    eager = sc.wrap(net, compile=False)
    fast = sc.wrap(net, compile=True)
    for plan in plans:
        eager.plan = fast.plan = plan
        torch.manual_seed(1)
        want = _step(eager, net, x)
        torch.manual_seed(1)
        got = _step(fast, net, x)
        assert fast.last_stats.step_compiled and not eager.last_stats.step_compiled, plan
        _same(want, got, bitwise)


@pytest.mark.parametrize("learn", [False, True])
def test_the_compiled_step_is_the_eager_one_on_every_plan(learn: bool) -> None:
    """Two Linear + Leaky layers, batch 1 and 3 features (the shapes where inductor would
    rewrite the products into sums; kept as ATen calls here), T = 11 over BPTT, Uniform,
    Revolve and Double: bitwise. With a learnable per-neuron decay and a learnable scalar
    threshold the outputs stay bitwise and the gradients agree to round-off: the threshold's
    gradient is a sum over the neurons, which inductor's reduction adds in another order."""
    torch.manual_seed(0)
    first = snn.Leaky(beta=torch.rand(3), learn_beta=learn, learn_threshold=learn)
    net = nn.Sequential(
        nn.Linear(3, 3), first, nn.Linear(3, 3), snn.Leaky(beta=0.8, reset_mechanism="zero")
    )
    with torch.no_grad():
        net[0].weight.mul_(3.0)
    x = (torch.rand(11, 1, 3) < 0.5).float()
    _both(net, x, PLANS, bitwise=not learn)


def test_dropout_compiles_bitwise() -> None:
    """Dropout draws from ATen's generator as it does eagerly (its decomposition kept out),
    so the masks are the same and the recomputation's replay of the random state holds."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.3), snn.Leaky(beta=0.9)).train()
    x = (torch.rand(9, 5, 4) < 0.5).float()
    _both(net, x, [sc.plans.BPTT(), sc.plans.Uniform(interval=4)])


def test_batchnorm_compiles_at_round_off() -> None:
    """BatchNorm in training mode: outputs and running statistics bitwise the eager run's,
    gradients within float32 round-off of the largest (the Linear bias before it has a
    gradient of zero up to round-off, which the two runs round differently)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), snn.Leaky(beta=0.9)).train()
    x = (torch.rand(9, 5, 4) < 0.5).float()
    start = {k: v.clone() for k, v in net.state_dict().items()}
    runs = []
    for choice in (False, True):
        net.load_state_dict(start)
        seq = sc.wrap(net, compile=choice, plan=sc.plans.Uniform(interval=4))
        runs.append((*_step(seq, net, x), net[1].running_mean.clone()))
        assert seq.last_stats.step_compiled is choice
    (out_a, grads_a, mean_a), (out_b, grads_b, mean_b) = runs
    assert torch.equal(out_a, out_b) and torch.equal(mean_a, mean_b)
    scale = max(float(g.abs().max()) for g in grads_a)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * scale)


def test_each_wrapped_model_compiles_its_own_step() -> None:
    """Dynamo keeps at most 8 compiled entries per code object: each wrapper's compiled step
    has its own, so twelve models in one process all run compiled (the shared code would have
    run the later ones eagerly)."""
    from torch._dynamo.utils import counters

    counters.clear()
    for width in range(1, 13):
        torch.manual_seed(width)
        net = nn.Sequential(nn.Linear(2, width), snn.Leaky(beta=0.9))
        seq = sc.wrap(net, compile=True, plan=sc.plans.BPTT())
        seq((torch.rand(3, 1, 2) < 0.5).float()).sum().backward()
        assert seq.last_stats.step_compiled
    assert not [k for k in counters["unimplemented"] if "recompile" in k.lower()]
    assert counters["stats"]["unique_graphs"] >= 12


def test_a_deep_copy_compiles_its_own_step() -> None:
    """``copy.deepcopy`` of a wrapped model that ran compiled: the copy compiles its own step
    (the original's is bound to the original's tensors) and its gradients go to its own
    parameters."""
    import copy

    net, x = _tiny()
    seq = sc.wrap(net, compile=True)
    want = _step(seq, net, x)
    twin = copy.deepcopy(seq)
    assert twin._compiled_step is None and seq._compiled_step is not None
    got = _step(twin, twin.module, x)
    assert twin.last_stats.step_compiled
    _same(want, got)
    assert all(p.grad is not None for p in twin.module.parameters())


def _tiny() -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 3), snn.Leaky(beta=0.9))
    return net, (torch.rand(5, 2, 2) < 0.5).float()


def test_without_a_compiler_the_step_runs_eagerly_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    net, x = _tiny()
    want = _step(sc.wrap(net, compile=False), net, x)
    monkeypatch.setattr(compiled_step, "compiler_missing", lambda device: "no C++ compiler found")
    compiled._WARNED.discard("no C++ compiler found")
    seq = sc.wrap(net, compile=True)
    with pytest.warns(UserWarning, match="running eagerly: no C\\+\\+ compiler found"):
        got = _step(seq, net, x)
    assert not seq.last_stats.step_compiled
    _same(want, got)


def test_a_failing_compiler_falls_back_to_the_eager_step(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(graph: Any, inputs: Any) -> Any:
        raise RuntimeError("inductor broke")

    net, x = _tiny()
    want = _step(sc.wrap(net, compile=False), net, x)
    monkeypatch.setattr(compiled_step, "exact_backend", lambda: broken)
    compiled._WARNED.clear()
    seq = sc.wrap(net, compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _step(seq, net, x)
        again = _step(seq, net, x)
    lines = [str(w.message) for w in caught if "torch.compile failed" in str(w.message)]
    assert lines == [
        "spikeckpt: running eagerly: torch.compile failed on the model's step "
        "(BackendCompilerFailed)"
    ]
    assert not seq.last_stats.step_compiled
    _same(want, got)
    _same(want, again)


def test_under_a_dispatch_mode_the_step_runs_eagerly_and_compiled_after() -> None:
    """Under ``MemoryMeter(mode="tensors")`` (a dispatch mode, as the planner's CPU probes run)
    the compiled step is not called: dynamo would skip the frame, and torch up to 2.13 then
    ran it eagerly for the rest of the process (checked with torch 2.13). Outside the mode
    it runs compiled again, inductor's code in the profile."""
    from spikeckpt.engine.meter import MemoryMeter

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), snn.Leaky(beta=0.9))
    x = (torch.rand(6, 2, 3) < 0.5).float()
    seq = sc.wrap(net, compile=True, plan=sc.plans.BPTT())
    want = _step(seq, net, x)
    assert seq.last_stats.step_compiled
    with MemoryMeter(mode="tensors") as meter:
        measured = _step(seq, net, x)
    assert meter.peak_bytes > 0 and not seq.last_stats.step_compiled
    _same(want, measured)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        again = _step(seq, net, x)
    assert seq.last_stats.step_compiled
    assert any("Compiled" in event.key for event in prof.key_averages())
    _same(want, again)
