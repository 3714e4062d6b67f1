"""Whole models as snnTorch users write them, against their own plain loop (a newcomer's
second hour): what went silently wrong before, now refused or fixed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.models import spike
from spikeckpt.plans import Revolve

snn = pytest.importorskip("snntorch")

T, B, N_IN = 12, 3, 10


class DropoutNet(nn.Module):
    """A user's whole network as one module ``forward(x_t, state) -> (spk, state)``, with a
    Dropout between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.lif1 = nn.Linear(N_IN, 16), snn.Leaky(beta=0.9)
        self.drop = nn.Dropout(0.3)
        self.fc2, self.lif2 = nn.Linear(16, 4), snn.Leaky(beta=0.9)

    def initial_state(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.new_zeros(x.shape[0], 16), x.new_zeros(x.shape[0], 4)

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Any]:
        mem1, mem2 = state
        spk1, mem1 = self.lif1(self.fc1(x), mem1)
        spk2, mem2 = self.lif2(self.fc2(self.drop(spk1)), mem2)
        return spk2, (mem1, mem2)


class DropoutBlock(nn.Module):
    """A one-step block of yours: ``Linear``, ``Dropout``, an ``init_hidden`` neuron."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(n_in, n_out), nn.Dropout(0.3)
        self.lif = snn.Leaky(beta=0.9, init_hidden=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.lif(self.drop(self.fc(x)))


class NoisyNeuron(nn.Module):
    """Spikes drawn from the default generator with probability ``sigmoid(v - 1)``."""

    def initial_state(self, x: Tensor) -> Tensor:
        return torch.zeros_like(x)

    def forward(self, x: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        v = 0.9 * v + x
        p = torch.sigmoid(v - 1)
        s = (torch.rand(v.shape) < p).float() + p - p.detach()
        return s, v - s.detach()


def _dropout_net() -> nn.Module:
    return DropoutNet()


def _blocks() -> nn.Module:
    return nn.Sequential(DropoutBlock(N_IN, 16), DropoutBlock(16, 4))


def _noisy() -> nn.Module:
    return nn.Sequential(nn.Linear(N_IN, 4), NoisyNeuron())


def _loop(model: nn.Module, x: Tensor) -> Tensor:
    """The plain loop: the user's per-step calls, states from zeros."""
    for m in model.modules():
        if isinstance(m, snn.Leaky) and m.init_hidden:
            m.mem = torch.zeros(())
    if isinstance(model, DropoutNet):
        state, out = model.initial_state(x[0]), []
        for t in range(x.shape[0]):
            spk, state = model(x[t], state)
            out.append(spk)
        return torch.stack(out)
    if isinstance(model[-1], NoisyNeuron):
        fc, neuron = model
        v, out = torch.zeros(x.shape[1], 4), []
        for t in range(x.shape[0]):
            spk, v = neuron(fc(x[t]), v)
            out.append(spk)
        return torch.stack(out)
    return torch.stack([model(x[t]) for t in range(x.shape[0])])


def _grads(model: nn.Module, out: Tensor) -> list[Tensor]:
    (out * torch.arange(1.0, 1.0 + out.shape[-1])).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("build", [_dropout_net, _blocks, _noisy], ids=["net", "blocks", "noisy"])
def test_neuron_modules_that_draw_random_numbers(build: Any) -> None:
    """A neuron module of yours that draws (a Dropout inside a ``forward(x, state)`` network
    or a one-step block, a stochastic neuron): layer-wise recomputed its chunks with other
    draws than the forward's (gradients 26-70% off the loop's; outputs equal where one block
    drew) and ``granularity="auto"`` picked it. Now layer-wise refuses it, naming the way, and
    ``"auto"`` runs the stack, whose gradients are the loop's."""
    x = (torch.rand(T, B, N_IN) < 0.4).float()
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    model = build()
    torch.manual_seed(3)
    expected = _loop(ref, x)
    want = _grads(ref, expected)
    with pytest.raises(sc.UnsupportedLayerError, match=r"may draw random numbers.*'stack'"):
        sc.wrap(model, granularity="layer", chunk=4)(x)
    seq = sc.wrap(model, granularity="auto", plan=Revolve(3))
    torch.manual_seed(3)
    out = seq(x)
    if isinstance(model, DropoutNet):  # a module of yours wrapped alone: (outputs, state)
        out, _ = out
    assert seq.last_decision.granularity == "stack"
    assert torch.equal(out, expected)
    for g, w in zip(_grads(model, out), want, strict=True):
        torch.testing.assert_close(g, w)


class LearnedStart(nn.Module):
    """A neuron of yours with a learnable initial membrane: ``initial_state(x)`` returns
    ``self.mem0`` broadcast over the batch."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.mem0 = nn.Parameter(torch.linspace(0.0, 0.9, n))
        self.beta = nn.Parameter(torch.full((n,), 0.9))

    def initial_state(self, x: Tensor) -> Tensor:
        return self.mem0.expand(x.shape[0], -1)

    def forward(self, x: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:
        mem = self.beta * mem + x
        spk = spike(mem - 1.0)
        return spk, mem - spk.detach()


@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_a_learnable_initial_state_gets_its_gradient(granularity: str) -> None:
    """In an ``nn.Sequential``, each layer's initial state was made inside the shape probe,
    under ``no_grad``: ``mem0.grad`` stayed None (the plain loop gives it one), silently."""
    x = (torch.rand(T, B, N_IN) < 0.4).float()

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(N_IN, 6), LearnedStart(6), nn.Linear(6, 3), LearnedStart(3))

    ref, model = build(), build()
    states = [ref[1].initial_state(x[0]), ref[3].initial_state(x[0])]
    out = []
    for t in range(T):
        spk, states[0] = ref[1](ref[0](x[t]), states[0])
        spk, states[1] = ref[3](ref[2](spk), states[1])
        out.append(spk)
    want = _grads(ref, torch.stack(out))
    got = sc.wrap(model, granularity=granularity, plan=Revolve(3))(x)
    assert torch.equal(got, torch.stack(out))
    grads = _grads(model, got)
    assert model[1].mem0.grad is not None and model[3].mem0.grad is not None
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("readout", ["sum", "mean"])
@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_a_bfloat16_readout_sums_as_the_loops_sum(readout: str, granularity: str) -> None:
    """Norse's ``LICell`` returns a bfloat16 voltage under CPU autocast. ``readout="sum"`` ran
    a bfloat16 running sum, which stops growing once a step's voltage is below half its
    spacing: 8192 against the loop's ``stack(vs).sum(0)`` = 14272 over 600 steps (42% off,
    silently). Now summed in float32 and rounded once, as torch's own ``sum(0)``. (The
    gradients: the autocast loop sums the weight's over all steps in bfloat16, 10% off the
    float32 loop's here; the wrapped run's are no farther.)"""
    norse = pytest.importorskip("norse.torch")
    steps = 300
    x = torch.rand(steps, 2, 4) + 0.5

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = norse.SequentialState(nn.Linear(4, 3), norse.LICell())
        with torch.no_grad():
            model[0].weight.abs_().add_(1.0)
        return model

    def loop(model: nn.Module, autocast: bool) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            state, vs = None, []
            for t in range(steps):
                v, state = model(x[t], state)
                vs.append(v)
            return torch.stack(vs).sum(0) if readout == "sum" else torch.stack(vs).mean(0)

    model32, ref, model = build(), build(), build()
    want32, want = loop(model32, False), loop(ref, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = sc.wrap(model, readout=readout, granularity=granularity)(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=0)
    exact = _grads(model32, want32.float())

    def off(grads: list[Tensor]) -> float:
        return max(
            float((g - e).abs().max() / e.abs().max()) for g, e in zip(grads, exact, strict=True)
        )

    assert off(_grads(model, got.float())) <= off(_grads(ref, want.float()))


def test_wrap_names_a_class_a_function_and_a_bad_readout_or_chunk_at_once() -> None:
    """``wrap(Net)`` (the class) raised ``TypeError: Module.named_modules() missing 1 required
    positional argument``, a function an ``AttributeError``; a misspelt readout and
    ``chunk=0`` passed ``wrap`` and failed at the first forward."""
    with pytest.raises(sc.ConfigTypeError, match=r"class DropoutNet.*wrap\(DropoutNet\(\.\.\.\)\)"):
        sc.wrap(DropoutNet)
    with pytest.raises(sc.ConfigTypeError, match=r"got function.*spikeckpt\.scan"):
        sc.wrap(lambda x: x)
    net = nn.Sequential(nn.Linear(3, 2), snn.Leaky(beta=0.9))
    with pytest.raises(sc.ConfigError, match="readout must be"):
        sc.wrap(net, readout="avg")
    with pytest.raises(sc.ConfigError, match="chunk must be"):
        sc.wrap(net, granularity="layer", chunk=0)


class SpikesAndMembrane(nn.Module):
    """A hand-written neuron that returns its spikes and membrane as its output, the way to
    record a membrane of yours (``output="mem"`` knows snnTorch's and Norse's only)."""

    def forward(self, x: Tensor, mem: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
        mem = 0.9 * mem + x
        spk = spike(mem - 1.0)
        mem = mem - spk.detach()
        return (spk, mem), mem


def test_a_neuron_returning_a_tuple_runs_in_the_stack_and_is_refused_layer_wise() -> None:
    """``granularity="auto"`` crashed measuring it (``'tuple' object has no attribute
    'detach'``), ``"layer"`` in the run (``expected Tensor as element 0``). Now ``"auto"``
    runs the stack (the loop's outputs and gradients), ``"layer"`` names the layer."""
    x = (torch.rand(T, B, N_IN) < 0.4).float()

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(N_IN, 5), SpikesAndMembrane())

    ref, model = build(), build()
    fc, neuron = ref
    mem, spikes, mems = torch.zeros(B, 5), [], []
    for t in range(T):
        (spk, m), mem = neuron(fc(x[t]), mem)
        spikes.append(spk)
        mems.append(m)
    want = _grads(ref, torch.stack(spikes) + torch.stack(mems))
    seq = sc.wrap(model, granularity="auto", plan=Revolve(3))
    spk, m = seq(x)
    assert seq.last_decision.granularity == "stack"
    assert torch.equal(spk, torch.stack(spikes)) and torch.equal(m, torch.stack(mems))
    for g, w in zip(_grads(model, spk + m), want, strict=True):
        torch.testing.assert_close(g, w)
    with pytest.raises(sc.ConfigError, match=r"SpikesAndMembrane at '1'.*neuron of yours"):
        sc.wrap(nn.Sequential(nn.Linear(N_IN, 5), SpikesAndMembrane()), output="mem")
    for options in ({}, {"plan": "auto", "budget": "1MiB"}):
        with pytest.raises(sc.UnsupportedLayerError, match=r"'1'.*returns a tuple.*'stack'"):
            sc.wrap(model, granularity="layer", **options)(x)


def test_a_list_of_steps_as_input_is_refused_with_the_fix() -> None:
    """``seq([x_t, ...])`` (steps collected in a list, as some loops keep them) was an
    ``AttributeError`` ('list' object has no attribute 'shape'); now a `ConfigTypeError`
    saying to stack them, and the stacked steps give the plain loop's outputs."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), snn.Leaky(0.9, init_hidden=True))
    steps = [(torch.rand(2, 4) < 0.5).float() for _ in range(6)]
    seq = sc.wrap(net)
    with pytest.raises(sc.errors.ConfigTypeError, match=r"torch.stack\(x\)"):
        seq(steps)
    with pytest.raises(sc.errors.ConfigTypeError, match="got dict"):
        seq({"x": steps[0]})
    net[1].reset_mem()
    want = torch.stack([net(x_t) for x_t in steps])
    assert torch.equal(seq(torch.stack(steps)), want)
