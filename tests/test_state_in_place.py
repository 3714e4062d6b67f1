"""A neuron of yours that updates the state it is given in place (``mem.mul_(beta).add_(x)``):
the plain loop runs it (each state is used once), but a checkpointed run hands stored states
to its steps, and the shape probe hands it the zeros it then starts from. Before 2026-11-29
``plan=BPTT()`` returned other outputs than the loop's silently (every output step differed:
the probe had changed the initial zeros), and every other plan and granularity failed with
torch's "a leaf Variable that requires grad is being used in an in-place operation". Now the
call is refused, naming the layer and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc


class _Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v):  # type: ignore[override]
        ctx.save_for_backward(v)
        return (v > 0).float()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (v,) = ctx.saved_tensors
        return g / (1 + (10 * v) ** 2)


class InPlaceLIF(nn.Module):
    def forward(self, x, mem):
        mem.mul_(0.9).add_(x)  # the state argument changed in place
        spk = _Spike.apply(mem - 1.0)
        return spk, mem - spk.detach()


class CopyLIF(nn.Module):
    def forward(self, x, mem):
        mem = mem * 0.9 + x
        spk = _Spike.apply(mem - 1.0)
        mem = mem.clone()
        mem.sub_(spk.detach())  # in place on its own new tensor: fine
        return spk, mem


def _net(cls: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 12), cls(), nn.Linear(12, 4), cls())


def _loop(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    mems = [torch.zeros(x.shape[1], 12), torch.zeros(x.shape[1], 4)]
    out = []
    for x_t in x:
        s, mems[0] = net[1](net[0](x_t), mems[0])
        s, mems[1] = net[3](net[2](s), mems[1])
        out.append(s)
    return torch.stack(out)


CONFIGS = [
    dict(plan=sc.plans.BPTT()),
    dict(plan=sc.plans.Revolve(2)),
    dict(granularity="layer"),
    dict(granularity="auto"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_state_changed_in_place_is_refused(cfg):
    torch.manual_seed(0)
    x = torch.rand(20, 3, 8) * 0.6
    seq = sc.wrap(_net(InPlaceLIF), **cfg)
    with pytest.raises(sc.UnsupportedLayerError, match=r"layer '1'.*in place.*mem = mem \*"):
        seq(x)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_in_place_on_its_own_tensor_is_the_loops(cfg):
    torch.manual_seed(0)
    x = torch.rand(20, 3, 8) * 0.6
    ref, net = _net(CopyLIF), _net(CopyLIF)
    _loop(ref, x).pow(2).sum().backward()
    out = sc.wrap(net, **cfg)(x)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, _loop(_net(CopyLIF), x))
    for p, q in zip(ref.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)


@pytest.mark.parametrize("plan", [sc.plans.Revolve(2), sc.plans.Uniform(4)])
def test_scan_step_changing_its_state_in_place_is_told(plan):
    torch.manual_seed(0)
    fc, x = nn.Linear(6, 5), torch.rand(12, 3, 6)

    def step(v, x_t):
        v.mul_(0.9).add_(fc(x_t))
        s = _Spike.apply(v - 1.0)
        return v - s.detach(), s

    with pytest.raises(sc.UsageError, match=r"in place.*v = v \* 0.9 \+ x"):
        out, _ = sc.scan(step, x, torch.zeros(3, 5), plan=plan)
        out.sum().backward()


def test_readout_accumulating_in_place_is_told():
    torch.manual_seed(0)
    fc, x = nn.Linear(6, 5), torch.rand(12, 3, 6)

    def step(v, x_t):
        v = 0.9 * v + fc(x_t)
        return v, torch.tanh(v)

    def fold(acc, y, t):
        if acc is None:
            return y.clone()
        acc += y
        return acc

    with pytest.raises(sc.UsageError, match=r"readout changes its accumulator in place"):
        out, _ = sc.scan(step, x, torch.zeros(3, 5), plan=sc.plans.Uniform(4), readout=fold)
        out.sum().backward()
