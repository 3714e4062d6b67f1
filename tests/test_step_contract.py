"""How a layer of yours is read as one step: ``forward(x, s1, ..., sk) -> (y, s1, ..., sk)``.

Found by a helper session writing models as snnTorch's docs write them (2026-11-28):

- snnTorch's ``Leaky`` docstring writes a one-step net as ``forward(x, mem1, spk1, mem2) ->
  (mem1, spk1, mem2, spk2)``, the states first: read by arity it ran with every state in
  another's slot (outputs 4.9 off the loop's) and no error. Now refused from the names in its
  return statement, with the return to write;
- a neuron of yours built on snnTorch's classes with its own forward (``class
  MyLIF(snn.LIF)``; a ``Leaky`` whose forward takes one more state) was refused as "no step
  adapter" or failed with a bare ``TypeError``; now stepped by arity, as the loop runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.adapters.returns import returned_names, state_order_problem
from spikeckpt.errors import UnsupportedLayerError
from spikeckpt.plans import BPTT, Revolve, Uniform

snn = pytest.importorskip("snntorch")
snn_utils = pytest.importorskip("snntorch.utils")

T, B, N_IN, H, N_OUT = 13, 3, 6, 8, 5
PLANS = [BPTT(), Uniform(4), Revolve(2)]


@pytest.fixture(autouse=True)
def _snntorch_instances() -> Iterator[None]:
    """snnTorch lists every neuron built; one of these left there breaks ``utils.reset``."""
    before = list(snn.SpikingNeuron.instances)
    yield
    snn.SpikingNeuron.instances[:] = before


def _x() -> Tensor:
    return (torch.rand(T, B, N_IN, generator=torch.Generator().manual_seed(1)) < 0.4).float() * 2


def _grads(model: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _same_grads(a: list[Tensor], b: list[Tensor]) -> None:
    assert len(a) == len(b) > 0
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


class _DocNet(nn.Module):
    """snnTorch's Leaky docstring's net: its states returned before its output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.lif1 = nn.Linear(N_IN, H), snn.Leaky(beta=0.9)
        self.fc2, self.lif2 = nn.Linear(H, N_OUT), snn.Leaky(beta=0.8)

    def forward(self, x: Tensor, mem1: Tensor, spk1: Tensor, mem2: Tensor) -> Any:
        spk1, mem1 = self.lif1(self.fc1(x), mem1)
        spk2, mem2 = self.lif2(self.fc2(spk1), mem2)
        return mem1, spk1, mem2, spk2


class _FixedDocNet(_DocNet):
    """The same net returning what the refusal names: the output first."""

    def forward(self, x: Tensor, mem1: Tensor, spk1: Tensor, mem2: Tensor) -> Any:
        spk1, mem1 = self.lif1(self.fc1(x), mem1)
        spk2, mem2 = self.lif2(self.fc2(spk1), mem2)
        return spk2, mem1, spk1, mem2


def test_states_returned_before_the_output_are_refused_with_the_return_to_write() -> None:
    with pytest.raises(UnsupportedLayerError) as err:
        sc.wrap(_DocNet(), plan=BPTT())(_x())
    message = str(err.value)
    assert "returns (mem1, spk1, mem2, spk2)" in message
    assert "return spk2, mem1, spk1, mem2" in message


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_the_return_it_names_runs_as_the_loop(plan: Any) -> None:
    torch.manual_seed(0)
    net, x = _FixedDocNet(), _x()
    mem1, spk1, mem2 = torch.zeros(B, H), torch.zeros(B, H), torch.zeros(B, N_OUT)
    ys = []
    for x_t in x:
        spk2, mem1, spk1, mem2 = net(x_t, mem1, spk1, mem2)
        ys.append(spk2)
    loop = torch.stack(ys)
    (loop * torch.arange(1.0, T + 1)[:, None, None]).sum().backward()
    expected = _grads(net)
    net.zero_grad()
    out, _ = sc.wrap(net, plan=plan)(x)  # a net taking states returns (ys, final states)
    assert torch.equal(out, loop)
    (out * torch.arange(1.0, T + 1)[:, None, None]).sum().backward()
    _same_grads(_grads(net), expected)


def _returns_swapped(self: Any, x: Tensor, mem: Tensor, syn: Tensor) -> Any:
    spk, syn, mem = x, syn, mem
    return spk, syn, mem


def _returns_in_order(self: Any, x: Tensor, mem: Tensor, syn: Tensor) -> Any:
    spk = x
    if x.sum() > 0:
        return spk, mem, syn
    return (spk, mem, syn)


def _returns_a_call(self: Any, x: Tensor, mem: Tensor) -> Any:
    return x.sum(), mem


def test_the_order_is_read_from_plain_names_only() -> None:
    assert returned_names(_returns_in_order) == [("spk", "mem", "syn")] * 2
    assert returned_names(_returns_a_call) == []
    assert state_order_problem(_returns_in_order.__get__(object()), 2) is None
    assert state_order_problem(_returns_a_call.__get__(object()), 1) is None
    swapped = state_order_problem(_returns_swapped.__get__(object()), 2)
    assert swapped is not None and "return spk, mem, syn" in swapped


class _MyLIF(snn.LIF):
    """A neuron written as snnTorch's docs write one: its own forward on snnTorch's LIF."""

    def __init__(self, beta: float, init_hidden: bool = False) -> None:
        super().__init__(beta=beta, init_hidden=init_hidden)

    def forward(self, input_: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:
        reset = self.mem_reset(mem)
        mem = self.beta.clamp(0, 1) * mem + input_ - reset * self.threshold
        return self.fire(mem), mem


class _Adaptive(snn.Leaky):
    """A ``Leaky`` with one more state: an adaptation current fed back."""

    def forward(self, input_: Tensor, mem: Tensor, a: Tensor) -> Any:  # type: ignore[override]
        spk, mem = super().forward(input_ - a, mem)
        return spk, mem, 0.9 * a + 0.5 * spk


def _loop(fc: nn.Module, neuron: nn.Module, x: Tensor, n_state: int) -> Tensor:
    state = tuple(torch.zeros(B, H) for _ in range(n_state))
    ys = []
    for x_t in x:
        spk, *rest = neuron(fc(x_t), *state)
        state = tuple(rest)
        ys.append(spk)
    return torch.stack(ys)


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("kind", ["LIF subclass", "Leaky with one more state"])
def test_snntorch_neurons_of_yours_run_as_their_loop(
    kind: str, plan: Any, granularity: str
) -> None:
    torch.manual_seed(0)
    fc = nn.Linear(N_IN, H)
    neuron, n_state = (_MyLIF(0.9), 1) if kind == "LIF subclass" else (_Adaptive(0.85), 2)
    net, x = nn.Sequential(fc, neuron), _x()
    loop = _loop(fc, neuron, x, n_state)
    assert 0 < loop.sum() < loop.numel()  # some steps fire, not all
    loop.pow(2).sum().backward()
    expected = _grads(net)
    net.zero_grad()
    out = sc.wrap(net, plan=plan, granularity=granularity)(x)
    torch.testing.assert_close(out, loop, rtol=0, atol=0)
    out.pow(2).sum().backward()
    _same_grads(_grads(net), expected)
    assert not any(  # nothing of the run is left on the module
        isinstance(v, Tensor) and v.numel() for k, v in neuron._buffers.items() if k == "mem"
    )


def test_a_neuron_of_yours_that_keeps_its_state_on_itself_is_refused() -> None:
    with pytest.raises(UnsupportedLayerError, match="init_hidden=False"):
        sc.wrap(nn.Sequential(nn.Linear(N_IN, H), _MyLIF(0.9, init_hidden=True)))(_x())


class _Counting(_MyLIF):
    def forward(self, input_: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:
        spk, mem = super().forward(input_, mem)
        self.fired = spk.sum()
        return spk, mem


def test_a_neuron_of_yours_keeping_more_on_itself_is_refused_naming_it() -> None:
    with pytest.raises(UnsupportedLayerError, match="self.fired"):
        sc.wrap(nn.Sequential(nn.Linear(N_IN, H), _Counting(0.9)), plan=Uniform(4))(_x())


def test_a_scan_step_keeping_state_on_its_neurons_names_why_it_cannot_recompute() -> None:
    """A step calling init_hidden=True neurons (state on the modules, not in its arguments):
    a recomputing plan failed with torch's bare "backward through the graph a second time";
    now the message names the hidden state and the ways out, and BPTT() runs as the loop."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(N_IN, H),
        snn.Leaky(0.9, init_hidden=True),
        nn.Linear(H, N_OUT),
        snn.Leaky(0.8, init_hidden=True),
    )
    x = _x()

    def step(state: Any, x_t: Tensor) -> tuple[Any, Tensor]:
        return state, net(x_t)

    snn_utils.reset(net)
    loop = torch.stack([net(x_t) for x_t in x])
    snn_utils.reset(net)
    out, _ = sc.scan(step, x, (), plan=BPTT())
    assert torch.equal(out, loop)
    snn_utils.reset(net)
    out, _ = sc.scan(step, x, (), plan=Uniform(4))
    with pytest.raises(sc.UsageError, match="keeps state outside its arguments.*init_hidden=True"):
        out.sum().backward()


@pytest.mark.parametrize("how", ["surrogate_disable", "spike_grad without a gradient"])
def test_spikes_without_a_gradient_leave_the_layers_before_them_none_as_the_loop(how: str) -> None:
    """The fused kernel handed zeros where the loop's graph is cut (``.grad`` None): an
    optimizer with weight decay then moved weights the loop leaves alone (AdamW: 3.2e-4 in one
    step). Such a neuron now steps per call, layer-wise too."""

    def neuron(beta: float) -> nn.Module:
        if how == "surrogate_disable":
            return snn.Leaky(beta=beta, surrogate_disable=True)
        return snn.Leaky(beta=beta, spike_grad=lambda u: (u > 0).float())

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(N_IN, H), neuron(0.9), nn.Linear(H, N_OUT), neuron(0.8))

    x = _x()
    loop, net = make(), make()
    m1, m2, mems = loop[1].init_leaky(), loop[3].init_leaky(), []
    for x_t in x:
        s1, m1 = loop[1](loop[0](x_t), m1)
        _, m2 = loop[3](loop[2](s1), m2)
        mems.append(m2)
    torch.stack(mems).sum().backward()
    seq = sc.wrap(net, granularity="layer", output="mem")
    seq(x).sum().backward()
    assert [b.neuron for b in seq.last_stats.blocks] == ["per-step", "per-step"]
    for p, q in zip(loop.parameters(), net.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
    assert net[0].weight.grad is None
