"""Cases a differential fuzz of the layer-wise kernels (``RLeaky``, ``RSynaptic``, Norse's
``LIFRecurrentCell`` and the snnTorch neurons sharing their checks) found giving other results
than the framework's own loop, each against that loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import snntorch as snn
import torch
from snntorch import utils
from torch import Tensor, nn

import spikeckpt as sc


class _FiresAtThreshold(torch.autograd.Function):
    """A user's surrogate spike whose forward fires at ``u >= 0``: at the threshold itself,
    where snnTorch's own (``u > 0``) does not."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, u: Tensor) -> Tensor:
        ctx.save_for_backward(u)
        return (u >= 0).float()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: Tensor) -> Tensor:
        (u,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return g / (1 + (torch.pi * u) ** 2)


_AT_THRESHOLD: dict[str, Callable[[], nn.Module]] = {
    "RLeaky": lambda: snn.RLeaky(
        beta=0.5, linear_features=2, spike_grad=_FiresAtThreshold.apply, init_hidden=True
    ),
    "RSynaptic one-to-one": lambda: snn.RSynaptic(
        alpha=0.5,
        beta=0.5,
        all_to_all=False,
        V=0.25,
        spike_grad=_FiresAtThreshold.apply,
        init_hidden=True,
    ),
    "Leaky": lambda: snn.Leaky(beta=0.5, spike_grad=_FiresAtThreshold.apply, init_hidden=True),
    "Synaptic": lambda: snn.Synaptic(
        alpha=0.5, beta=0.5, spike_grad=_FiresAtThreshold.apply, init_hidden=True
    ),
}


@pytest.mark.parametrize("name", sorted(_AT_THRESHOLD))
def test_a_surrogate_firing_at_the_threshold_itself_is_not_fused(name: str) -> None:
    """The kernels compute snnTorch's spike ``u > 0`` themselves (they never call the spike
    function), and their one check runs on random values, never exactly at the threshold: a
    user's surrogate firing at ``u >= 0`` was fused and silently missed every spike of a
    membrane reaching the threshold exactly (an input of 1.0 against a threshold of 1.0). Such
    a neuron steps per call: spikes bitwise snnTorch's loop, gradients its own."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2), _AT_THRESHOLD[name]())
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.5, 0.5]]))
        net[0].bias.zero_()
        recurrent = getattr(net[1], "recurrent", None)
        if isinstance(recurrent, nn.Linear):
            recurrent.weight.fill_(0.25)
            recurrent.bias.zero_()
    x = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])[:, None].repeat(3, 2, 1)
    utils.reset(net)
    want = torch.stack([net(x_t) for x_t in x])
    want_grads = torch.autograd.grad(want.sum(), list(net.parameters()), allow_unused=True)
    utils.reset(net)
    assert want.sum() > 0  # the membrane reaches the threshold exactly
    seq = sc.wrap(net, granularity="layer", chunk=4)
    got = seq(x)
    assert seq.last_stats.blocks[0].neuron == "per-step"
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad(got.sum(), list(net.parameters()), allow_unused=True)
    for a, b in zip(want_grads, got_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


class _ClippedSpike(torch.autograd.Function):
    """A user's surrogate whose backward clips the gradient it receives: not linear in it."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, u: Tensor) -> Tensor:
        ctx.save_for_backward(u)
        return (u > 0).float()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: Tensor) -> Tensor:
        (u,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return g.clamp(-20.0, 20.0) / (1 + 5 * u.abs()) ** 2


@pytest.mark.parametrize("neuron", ["RLeaky", "RSynaptic", "RLeaky one-to-one"])
def test_a_surrogate_not_linear_in_its_gradient_gets_each_steps_gradient(neuron: str) -> None:
    """The recurrent kernel ran the spike function's backward once per chunk with a gradient
    of ones and multiplied each step's gradient in after it: a surrogate clipping its gradient
    gave the first Linear's weight a gradient 0.23 off (relative), the block saying 'fused'."""
    torch.manual_seed(0)
    options = dict(spike_grad=_ClippedSpike.apply, learn_threshold=True)
    lif = {
        "RLeaky": lambda: snn.RLeaky(beta=0.8, linear_features=12, **options),
        "RSynaptic": lambda: snn.RSynaptic(alpha=0.7, beta=0.8, linear_features=12, **options),
        "RLeaky one-to-one": lambda: snn.RLeaky(beta=0.8, all_to_all=False, V=0.5, **options),
    }[neuron]()
    net = nn.Sequential(nn.Linear(10, 12), lif)
    x = torch.rand(9, 3, 10) * 3
    state = lif.init_rsynaptic() if neuron == "RSynaptic" else lif.init_rleaky()
    mems = []
    for x_t in x:
        (*state,) = lif(net[0](x_t), *state)
        mems.append(state[-1])
    want = torch.stack(mems)
    params = list(net.parameters())
    want_grads = torch.autograd.grad((want.pow(2).sum() * 50), params)
    # exact=True: the first Linear step by step, as the loop (a chunk's product may round
    # differently from the per-step ones on some CPUs: an AMD EPYC's MKL here)
    seq = sc.wrap(net, granularity="layer", chunk=4, output="mem", exact=True)
    got = seq(x)
    assert seq.last_stats.blocks[0].neuron == "fused"
    assert torch.equal(got, want)
    for a, b in zip(want_grads, torch.autograd.grad(got.pow(2).sum() * 50, params), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-3)
