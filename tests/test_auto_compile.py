"""``compile="auto"`` on the stack granularity (`spikeckpt.engine.auto_compile`): eager until
a shape's eager calls took `COMPILE_AFTER_SECONDS`, then compiled, timed against eager and
kept only where faster; the results those of the eager step throughout."""

from __future__ import annotations

import pytest
import snntorch as snn
import torch
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.engine import auto_compile, compiled
from spikeckpt.engine.meter import MemoryMeter

pytestmark = [
    pytest.mark.slow,  # the step compiles for a few seconds
    pytest.mark.skipif(
        compiled.compiler_missing("cpu") is not None, reason="no C++ compiler for inductor"
    ),
]

CALLS = auto_compile.WARMUP_CALLS + auto_compile.TRIAL_CALLS


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _model() -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), snn.Leaky(beta=0.9), nn.Linear(8, 4), snn.Leaky(0.8))
    return net, (torch.rand(40, 2, 3) < 0.5).float()


def _step(seq: nn.Module, net: nn.Module, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    net.zero_grad(set_to_none=True)
    out = seq(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), [p.grad.clone() for p in net.parameters()]


def _same(want: tuple[Tensor, list[Tensor]], got: tuple[Tensor, list[Tensor]]) -> None:
    """Outputs bitwise; gradients bitwise (no learnable neuron parameters here)."""
    assert torch.equal(want[0], got[0])
    for a, b in zip(want[1], got[1], strict=True):
        assert torch.equal(a, b)


def _shape(seq: nn.Module) -> auto_compile._Shape:
    policy = seq._compiled_step
    assert isinstance(policy, auto_compile.AutoCompiledStep)
    (shape,) = policy.shapes.values()
    return shape


@pytest.mark.parametrize("kept", [True, False])
def test_auto_compiles_after_the_eager_time_and_keeps_the_faster_step(
    monkeypatch: pytest.MonkeyPatch, kept: bool
) -> None:
    """The first call runs eagerly and passes the (lowered) threshold; the next ones run
    compiled: two compiling, two timed; then the choice holds (`KEEP_RATIO` infinite keeps the
    compiled step, 0 drops it). Every call's results are the eager wrap's."""
    monkeypatch.setattr(auto_compile, "COMPILE_AFTER_SECONDS", 1e-6)
    # kept whatever the timings (a noisy clock made the compiled step 10x slower once)
    monkeypatch.setattr(auto_compile, "KEEP_RATIO", float("inf") if kept else 0.0)
    net, x = _model()
    eager = sc.wrap(net, plan=sc.plans.Uniform(interval=7), compile=False)
    seq = sc.wrap(net, plan=sc.plans.Uniform(interval=7))  # compile="auto", the default
    want = _step(eager, net, x)
    ran = []
    for _ in range(CALLS + 3):
        _same(want, _step(seq, net, x))
        ran.append(seq.last_stats.step_compiled)
    assert ran == [False] + [True] * CALLS + [kept] * 2
    shape = _shape(seq)
    assert shape.compiled is kept and shape.compiled_calls == CALLS + (2 if kept else 0)
    assert 0 < shape.compiled_per_step < float("inf") and shape.eager_per_step > 0
    assert not eager.last_stats.step_compiled


def test_auto_stays_eager_below_the_threshold_and_counts_each_shape_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the library's threshold (5 s) a short run never compiles; each input shape
    accrues its own eager time."""
    monkeypatch.setattr(auto_compile, "COMPILE_AFTER_SECONDS", 5.0)
    net, x = _model()
    seq = sc.wrap(net, plan=sc.plans.BPTT())
    for batch in (x, x, x[:, :1]):
        _step(seq, net, batch)
        assert not seq.last_stats.step_compiled
    policy = seq._compiled_step
    assert isinstance(policy, auto_compile.AutoCompiledStep)
    spent = sorted(s.eager_seconds for s in policy.shapes.values())
    assert len(spent) == 2 and 0 < spent[0] < spent[1] < 5.0


def test_auto_keeps_a_hooked_model_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward hook (installed around each call by the hook guard) would recompile the step
    at every call: such a model stays eager, its hook called at every step."""
    monkeypatch.setattr(auto_compile, "COMPILE_AFTER_SECONDS", 0.0)
    net, x = _model()
    calls: list[int] = []
    net[1].register_forward_hook(lambda module, args, out: calls.append(1))
    counts = []
    for mode in (False, "auto"):
        seq = sc.wrap(net, plan=sc.plans.BPTT(), compile=mode)
        calls.clear()
        for _ in range(3):
            _step(seq, net, x)
            assert not seq.last_stats.step_compiled
        counts.append(len(calls))
    assert counts[0] == counts[1] >= 3 * x.shape[0]


def test_auto_neither_times_nor_compiles_under_the_meter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `MemoryMeter`'s tensor mode (a dispatch mode: compiled code must not run) a call
    runs eagerly and its time is not counted."""
    monkeypatch.setattr(auto_compile, "COMPILE_AFTER_SECONDS", 0.0)
    net, x = _model()
    seq = sc.wrap(net, plan=sc.plans.BPTT())
    want = _step(sc.wrap(net, plan=sc.plans.BPTT(), compile=False), net, x)
    with MemoryMeter(mode="tensors") as meter:
        _same(want, _step(seq, net, x))
    assert meter.peak_bytes > 0 and not seq.last_stats.step_compiled
    shape = _shape(seq)
    assert shape.eager_seconds == 0 and shape.compiled_calls == 0
    _same(want, _step(seq, net, x))  # outside the meter: compiled (threshold 0)
    assert seq.last_stats.step_compiled


def test_auto_without_a_compiler_says_so_once_when_it_would_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spikeckpt.engine import compiled_step

    monkeypatch.setattr(auto_compile, "COMPILE_AFTER_SECONDS", 1e-6)
    monkeypatch.setattr(compiled_step, "compiler_missing", lambda device: "no C++ compiler found")
    compiled._WARNED.discard("no C++ compiler found")
    net, x = _model()
    seq = sc.wrap(net, plan=sc.plans.BPTT())
    want = _step(seq, net, x)  # eager, under the threshold: nothing said
    with pytest.warns(UserWarning, match="running eagerly: no C\\+\\+ compiler found"):
        _same(want, _step(seq, net, x))
    for _ in range(2):
        _same(want, _step(seq, net, x))
        assert not seq.last_stats.step_compiled
    assert _shape(seq).compiled is False
