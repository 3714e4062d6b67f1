"""A neuron of yours, ``forward(x, mem) -> (spk, mem)``, that also keeps something on itself
(an adaptation ``self.a``, detached; a leak ``self.beta = torch.sigmoid(raw)`` assigned in
forward) is refused at its first step, naming the attribute, as a ``forward(x)`` layer of
yours is. Before: the detached adaptation ran with gradients 26-98% off the loop's
(recomputed steps read the value the last step left), silently; the assigned leak ran once
and was refused at the next call as "assigned before the call"."""

from __future__ import annotations

import pytest
import snntorch as snn
import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt import plans


class _Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(v)
        return (v > 0).to(v.dtype)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:  # type: ignore[override]
        (v,) = ctx.saved_tensors
        return g / (1 + 10 * v.abs()) ** 2


class HybridALIF(nn.Module):
    """Membrane passed explicitly, adaptation kept on the module (detached)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.raw = nn.Parameter(torch.linspace(-1.0, 2.0, n))
        self.a = torch.zeros(())

    def forward(self, x: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:
        thr = 1.0 + 0.5 * self.a
        mem = torch.sigmoid(self.raw) * mem + x
        spk = _Spike.apply(mem - thr)
        self.a = 0.9 * self.a + spk.detach()
        return spk, mem - spk.detach() * thr


class AssignedLeak(nn.Module):
    """Its leak computed from a raw parameter and assigned on itself in forward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.raw = nn.Parameter(torch.linspace(-1.0, 2.0, n))
        self.register_buffer("beta", torch.zeros(n))

    def forward(self, x: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:
        self.beta = torch.sigmoid(self.raw)
        mem = self.beta * mem + x
        spk = _Spike.apply(mem - 1.0)
        return spk, mem - spk.detach()


class SigmoidLeaky(snn.Leaky):
    """snnTorch's Leaky whose forward sets its beta buffer from a raw parameter."""

    def __init__(self, n: int) -> None:
        super().__init__(beta=torch.full((n,), 0.9))
        self.raw = nn.Parameter(torch.linspace(-1.0, 2.0, n))

    def forward(self, x: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        self.beta = torch.sigmoid(self.raw)
        return super().forward(x, mem)


@pytest.mark.parametrize("cls", [HybridALIF, AssignedLeak, SigmoidLeaky])
@pytest.mark.parametrize(
    "kw",
    [{"plan": plans.Uniform(3)}, {"plan": plans.Uniform(3), "granularity": "layer"}],
    ids=["stack", "layer"],
)
def test_state_kept_on_a_neuron_of_yours_is_refused_naming_it(cls: type, kw: dict) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 6), cls(6))
    with pytest.raises(spikeckpt.UnsupportedLayerError, match=r"layer '1'.*self\.(a|buffer beta)"):
        spikeckpt.wrap(net, **kw)(torch.rand(9, 3, 8) * 1.5).sum().backward()


class LocalLeak(AssignedLeak):
    """The same leak kept in a local variable: runs as the loop."""

    def forward(self, x: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:
        beta = torch.sigmoid(self.raw)
        mem = beta * mem + x
        spk = _Spike.apply(mem - 1.0)
        return spk, mem - spk.detach()


def test_a_leak_in_a_local_variable_runs_as_the_loop_on_two_calls() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 6), LocalLeak(6))
    seq = spikeckpt.wrap(net, plan=plans.Uniform(3))
    for _ in range(2):
        x = torch.rand(9, 3, 8) * 1.5
        net.zero_grad()
        mem, out = torch.zeros(3, 6), []
        for t in range(9):
            spk, mem = net[1](net[0](x[t]), mem)
            out.append(spk)
        torch.stack(out).sum().backward()
        want = [p.grad.clone() for p in net.parameters()]
        net.zero_grad()
        seq(x).sum().backward()
        for p, g in zip(net.parameters(), want, strict=True):
            torch.testing.assert_close(p.grad, g)


class HiddenMem(nn.Module):
    """init_hidden-style neuron of yours: the membrane kept on the module, forward(x)."""

    def __init__(self) -> None:
        super().__init__()
        self.mem = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        self.mem = 0.9 * self.mem + x
        spk = _Spike.apply(self.mem - 1.0)
        self.mem = self.mem - spk.detach()
        return spk


def test_a_hidden_state_neuron_of_yours_layerwise_says_how_to_write_it() -> None:
    net = nn.Sequential(nn.Linear(8, 6), HiddenMem())
    with pytest.raises(
        spikeckpt.UnsupportedLayerError, match=r"forward\(x, state\) -> \(y, state\)"
    ):
        spikeckpt.wrap(net, plan=plans.Uniform(3), granularity="layer")(torch.rand(9, 3, 8))
    with pytest.raises(spikeckpt.UnsupportedLayerError, match=r"layer '1'.*self\.mem"):
        spikeckpt.wrap(net, plan=plans.Uniform(3))(torch.rand(9, 3, 8))


def test_a_norse_subclass_keeping_a_buffer_is_refused_naming_it() -> None:
    norse = pytest.importorskip("norse.torch")

    class AdaptLIF(norse.LIFCell):  # type: ignore[misc, name-defined]
        """Norse's LIFCell with a detached adaptation in a registered buffer."""

        def __init__(self, n: int) -> None:
            super().__init__(p=norse.LIFParameters(v_th=torch.as_tensor(0.3)))
            self.register_buffer("a", torch.zeros(n))

        def forward(self, x: Tensor, state: object = None) -> tuple[Tensor, object]:
            z, state = super().forward(x - 0.5 * self.a, state)
            self.a = 0.9 * self.a + z.detach().mean(0)
            return z, state

    net = norse.SequentialState(nn.Linear(8, 6), AdaptLIF(6))
    with pytest.raises(spikeckpt.UnsupportedLayerError, match=r"layer '1'.*buffer a"):
        spikeckpt.wrap(net, plan=plans.Uniform(3))(torch.rand(9, 3, 8) * 3)


class AdaptingBlock(nn.Module):
    """A one-step block of yours around an init_hidden=True Leaky, its detached adaptation in
    a registered buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.lif = snn.Leaky(0.9, init_hidden=True)
        self.register_buffer("a", torch.zeros(6))

    def forward(self, x: Tensor) -> Tensor:
        s = self.lif(self.fc(x) - 0.5 * self.a)
        self.a = 0.9 * self.a + s.detach().mean(0)
        return s


def test_a_block_of_yours_keeping_a_buffer_is_refused_naming_it() -> None:
    with pytest.raises(spikeckpt.UnsupportedLayerError, match=r"layer '0'.*buffer a"):
        spikeckpt.wrap(nn.Sequential(AdaptingBlock()), plan=plans.Uniform(3))(torch.rand(9, 3, 8))
