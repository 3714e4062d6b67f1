"""An outer ``torch.compile`` around spikeckpt (``torch.compile(seq)``, ``seq.compile()``, a
compiled model or function that calls the wrapped model or `scan`): spikeckpt runs as
without it, exactly, and says so once (`spikeckpt.engine.outer_compile`). Before, dynamo
traced into the run and failed after a minute of recompiles with an internal guard error, and
``seq.compile()`` raised ``'str' object is not callable``."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import snntorch as snn
import torch
from quiet_trainer import quiet_trainer
from snntorch import utils as snn_utils
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.engine import compiled
from spikeckpt.engine.outer_compile import NOT_TRACED, OUTER_COMPILE

pytestmark = [
    pytest.mark.slow,  # dynamo traces (and inductor compiles) the code around spikeckpt
    pytest.mark.skipif(
        compiled.compiler_missing("cpu") is not None, reason="no C++ compiler for inductor"
    ),
]

T, B, F_IN = 13, 3, 12


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(F_IN, 10),
        snn.Leaky(beta=0.9, init_hidden=True),
        nn.Linear(10, 4),
        snn.Leaky(beta=0.8, init_hidden=True, output=True),
    )


def _input() -> Tensor:
    torch.manual_seed(1)
    return (torch.rand(T, B, F_IN) < 0.3).float()


def _loop(net: nn.Sequential, x: Tensor) -> Tensor:
    """snnTorch's own loop: the output spikes ``(T, B, 4)``."""
    snn_utils.reset(net)
    return torch.stack([net(x[t])[0] for t in range(x.shape[0])])


def _run(call: Callable[[Tensor], Any], net: nn.Module, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """One training step through ``call``, warnings recorded: the output spikes and every
    parameter's gradient."""
    net.zero_grad(set_to_none=True)
    out = call(x)
    spk = out[0] if isinstance(out, tuple) else out
    (spk * torch.linspace(-1, 1, spk.shape[-1])).sum().backward()
    return spk.detach(), [p.grad.clone() for p in net.parameters()]


def _recorded(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught]


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_a_compiled_wrapped_model_runs_as_the_eager_one(how: str, granularity: str) -> None:
    x = _input()
    ref_net = _net()
    ref = _run(lambda x: _loop(ref_net, x), ref_net, x)
    eager_net = _net()
    eager_seq = sc.wrap(eager_net, plan=sc.plans.Uniform(interval=4), granularity=granularity)
    eager = _run(eager_seq, eager_net, x)
    net = _net()
    seq = sc.wrap(net, plan=sc.plans.Uniform(interval=4), granularity=granularity)
    if how == "torch.compile":
        model: Any = torch.compile(seq)
    else:
        seq.compile()
        model = seq
    for _ in range(2):  # the first call traces; the second runs the cached frame
        got, messages = _recorded(lambda: _run(model, net, x))
        assert OUTER_COMPILE in messages
        assert torch.equal(got[0], ref[0])  # the loop's spikes
        for g, e in zip(got[1], eager[1], strict=True):
            assert torch.equal(g, e)  # the eager wrapped model's gradients, bitwise
        for g, r in zip(got[1], ref[1], strict=True):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert seq.last_stats is not None and seq.last_stats.completed  # the backward ran


class _Around(nn.Module):
    """A model of yours with the wrapped network inside: an encoder before it (compiled by the
    outer ``torch.compile``), a rate readout after it."""

    def __init__(self, snn_part: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.encoder = nn.Linear(F_IN, F_IN)
        self.snn = snn_part

    def forward(self, x: Tensor) -> Tensor:
        spk, _ = self.snn(torch.sigmoid(self.encoder(x)))
        return spk.mean(0)


def test_the_code_around_the_wrapped_model_still_compiles() -> None:
    x = _input()
    eager_model = _Around(sc.wrap(_net(), plan=sc.plans.Revolve(slots=2)))
    compiled_model = _Around(sc.wrap(_net(), plan=sc.plans.Revolve(slots=2)))
    fn = torch.compile(compiled_model)
    want = _run(eager_model, eager_model, x)
    got, messages = _recorded(lambda: _run(fn, compiled_model, x))
    assert OUTER_COMPILE in messages
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_compiled_function_calling_scan() -> None:
    """`scan` itself is an entry point: a compiled function around it runs it eagerly."""
    x = _input()
    torch.manual_seed(3)
    weight = nn.Parameter(torch.randn(F_IN, 5) * 0.5)

    def step(mem: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor]:
        mem = 0.9 * mem + x_t @ weight
        spk = snn.surrogate.atan()(mem - 1.0)
        return mem - spk, spk

    def run(x: Tensor) -> Tensor:
        ys, _ = sc.scan(step, x, torch.zeros(B, 5), plan=sc.plans.Uniform(interval=3))
        return ys

    want = _run(run, nn.ParameterList([weight]), x)
    got, messages = _recorded(lambda: _run(torch.compile(run), nn.ParameterList([weight]), x))
    assert OUTER_COMPILE in messages
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1][0], want[1][0])


def test_fullgraph_names_spikeckpt_and_the_way_forward() -> None:
    """``fullgraph=True`` allows no graph break: dynamo's error gives spikeckpt's reason (it
    was dynamo's ``_warnings.warn`` is not traceable, from inside spikeckpt)."""
    seq = sc.wrap(_net())
    with pytest.raises(Exception, match="spikeckpt's run is not traced") as caught:
        torch.compile(seq, fullgraph=True)(_input())
    assert NOT_TRACED in str(caught.value)


class _Classifier(pl.LightningModule):
    """docs/lightning.md's small run, with a ``forward`` (what ``torch.compile`` compiles)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = sc.wrap(_net()[:2], readout="sum")  # Linear(12, 10) + Leaky: 10 classes

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_compiled_lightning_module_trains_as_the_eager_one_within_the_budget() -> None:
    """``trainer.fit(torch.compile(module))`` with `MemoryBudget`: the callback finds the wrapped
    model through the compiled module, plans, and the weights after three steps are the eager
    fit's, bitwise."""
    from torch.utils.data import DataLoader

    from spikeckpt.lightning import MemoryBudget

    torch.manual_seed(0)
    batches = [((torch.rand(300, 4, F_IN) < 0.2).float(), torch.randint(0, 10, (4,)))] * 3
    weights, plans = [], []
    for compile_it in (False, True):
        module = _Classifier()
        callback = MemoryBudget("96KiB", margin=0.0, verbose=False)
        trainer = quiet_trainer([callback])
        model = torch.compile(module) if compile_it else module
        loader = DataLoader(batches, batch_size=None)
        _, messages = _recorded(functools.partial(trainer.fit, model, loader))
        assert (OUTER_COMPILE in messages) == compile_it
        assert callback.measured_peak_bytes is not None
        assert callback.measured_peak_bytes <= 96 * 1024
        plans.append(str(callback.plans["net"].plan))
        weights.append([p.detach().clone() for p in module.parameters()])
    assert plans[0] == plans[1] and plans[0] != "BPTT()"
    for eager, compiled_w in zip(*weights, strict=True):
        assert torch.equal(eager, compiled_w)


def test_a_compiled_wrapped_submodule_is_named_as_the_attribute() -> None:
    """``self.net = torch.compile(spikeckpt.wrap(...))``: the callback found the wrapped model
    as ``net._orig_mod``, so ``callback.plans["net"]`` (as documented) raised KeyError."""
    from torch.utils.data import DataLoader

    from spikeckpt.lightning import MemoryBudget

    torch.manual_seed(0)
    module = _Classifier()
    module.net = torch.compile(module.net)  # type: ignore[assignment]
    callback = MemoryBudget("96KiB", margin=0.0, verbose=False)
    batches = [((torch.rand(60, 4, F_IN) < 0.2).float(), torch.randint(0, 10, (4,)))]
    _recorded(functools.partial(quiet_trainer([callback]).fit, module, DataLoader(batches, None)))
    assert list(callback.plans) == ["net"]
