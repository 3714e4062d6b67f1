"""Model zoo, snnTorch: our own models with the structure of snnTorch's tutorials, each compared
with its own plain loop under Uniform, Double and Revolve (and layer-wise where it applies).

- tutorial 5: a fully connected net with its own time loop (``init_leaky()``, static input),
  and the hand-written neuron ``forward(input_, mem) -> (spk, mem)``;
- tutorial 6: a convolutional ``nn.Sequential`` of ``init_hidden=True`` neurons, here also with
  BatchNorm and Dropout; tutorial 7 (N-MNIST): the same with 2 input channels and event input;
- regression 1 (per-neuron learnable beta and threshold, a reset-free output neuron) and
  regression 2 (``RLeaky``, ``init_rleaky()``), both with their own loops;
- the spiking autoencoder (SAE): three ``nn.Sequential`` with BatchNorm, called in two loops;
- the binarised SNN (BSNN): custom binarised Conv2d/Linear, BatchNorm, Dropout, own loop.

Models with their own loop take the route of ``docs/own-model.md``: the loop body becomes a
step function handed to ``spikeckpt.scan``, initial states as written (``init_leaky()``).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from zoo_common import PLAN_IDS, PLANS, check

import spikeckpt as sc

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    snn = pytest.importorskip("snntorch")
    from snntorch import surrogate  # noqa: E402
    from snntorch import utils as snn_utils  # noqa: E402

T, B = 7, 3

# ----------------------------------------------------------------------------- tutorial 5


class FCN(nn.Module):
    """Tutorial 5's network: its own loop over ``num_steps`` with a static input."""

    def __init__(self, num_steps: int = T, beta: float = 0.9) -> None:
        super().__init__()
        self.num_steps = num_steps
        self.fc1 = nn.Linear(6, 10)
        self.lif1 = snn.Leaky(beta=beta, learn_beta=True)
        self.fc2 = nn.Linear(10, 4)
        self.lif2 = snn.Leaky(beta=beta)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # before: the tutorial's loop
        mem1 = self.lif1.init_leaky()
        mem2 = self.lif2.init_leaky()
        spk2_rec, mem2_rec = [], []
        for _step in range(self.num_steps):
            cur1 = self.fc1(x)
            spk1, mem1 = self.lif1(cur1, mem1)
            cur2 = self.fc2(spk1)
            spk2, mem2 = self.lif2(cur2, mem2)
            spk2_rec.append(spk2)
            mem2_rec.append(mem2)
        return torch.stack(spk2_rec, dim=0), torch.stack(mem2_rec, dim=0)

    def scanned(self, x: Tensor, plan: Any) -> tuple[Tensor, Tensor]:  # after
        mem1 = self.lif1.init_leaky()
        mem2 = self.lif2.init_leaky()

        def step(state: Any, x_t: Tensor) -> Any:
            mem1, mem2 = state
            cur1 = self.fc1(x_t)
            spk1, mem1 = self.lif1(cur1, mem1)
            cur2 = self.fc2(spk1)
            spk2, mem2 = self.lif2(cur2, mem2)
            return (mem1, mem2), (spk2, mem2)

        xs = x.expand(self.num_steps, *x.shape)  # the static input at every step, no copy
        (spk2_rec, mem2_rec), _ = sc.scan(step, xs, (mem1, mem2), plan=plan)
        return spk2_rec, mem2_rec


class LeakySurrogate(nn.Module):
    """Tutorial 5's hand-written neuron: ``forward(input_, mem) -> (spk, mem)``, arctan
    surrogate (here with a learnable decay)."""

    def __init__(self, n: int, beta: float = 0.9, threshold: float = 1.0) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.full((n,), beta))
        self.threshold = threshold
        self.spike_gradient = self.ATan.apply

    def forward(self, input_: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:
        spk = self.spike_gradient(mem - self.threshold)
        reset = (self.beta * spk * self.threshold).detach()
        mem = self.beta * mem + input_ - reset
        return spk, mem

    class ATan(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, mem: Tensor) -> Tensor:
            ctx.save_for_backward(mem)
            return (mem > 0).float()

        @staticmethod
        def backward(ctx: Any, grad_output: Tensor) -> Tensor:
            (mem,) = ctx.saved_tensors
            return 1 / (1 + (torch.pi * mem).pow(2)) * grad_output


def test_tutorial5_loop_model_is_refused_with_the_route() -> None:
    with pytest.raises(sc.UnsupportedLayerError) as info:
        sc.wrap(FCN())
    msg = str(info.value)
    assert "layer <root>" in msg and "lif1 (Leaky)" in msg
    assert "spikeckpt.scan(step, x, state" in msg and "init_leaky()" in msg


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_tutorial5_fcn(plan: Any) -> None:
    x = torch.rand(B, 6) * 1.5
    check(FCN, lambda m, x: m(x), lambda m, x: m.scanned(x, plan), x, "tutorial 5 FCN")


@settings(max_examples=12, deadline=None)
@given(
    steps=st.integers(1, 9),
    batch=st.integers(1, 3),
    plan=st.sampled_from(PLANS),
)
def test_tutorial5_fcn_any_length(steps: int, batch: int, plan: Any) -> None:
    """T from 1 (step 0 alone) to 9, smaller and larger than the plans' intervals."""
    x = torch.rand(batch, 6) * 1.5
    check(
        lambda: FCN(num_steps=steps),
        lambda m, x: m(x),
        lambda m, x: m.scanned(x, plan),
        x,
        "tutorial 5 FCN",
    )


def hand_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), LeakySurrogate(8))


def hand_loop(model: nn.Sequential, x: Tensor) -> Tensor:
    fc, lif = model
    mem = torch.zeros(x.shape[1], 8)
    spk_rec = []
    for step in range(x.shape[0]):
        spk, mem = lif(fc(x[step]), mem)
        spk_rec.append(spk)
    return torch.stack(spk_rec)


#: how each zoo route is wrapped: the two granularities, and layer-wise with ``exact=True``
#: (every synapse step by step, as the loop calls it)
GRANULARITIES = {
    "stack": {"granularity": "stack"},
    "layer": {"granularity": "layer"},
    "layer-exact": {"granularity": "layer", "exact": True},
}


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_tutorial5_hand_written_neuron_wraps_unchanged(plan: Any, granularity: str) -> None:
    """``forward(input_, mem)``: the protocol by arity; state starts as zeros shaped like the
    step's."""
    x = torch.rand(T, B, 6) * 2
    route = lambda m, x: sc.wrap(m, plan=plan, **GRANULARITIES[granularity])(x)  # noqa: E731
    check(hand_net, hand_loop, route, x, "tutorial 5 hand-written neuron")


# ----------------------------------------------------------------------------- tutorials 6, 7


def csnn(channels: int = 1, norm: bool = True, dropout: float = 0.25) -> nn.Sequential:
    """Tutorial 6/7's convolutional ``nn.Sequential`` (here with BatchNorm and Dropout)."""
    grad = surrogate.fast_sigmoid(slope=25)
    layers: list[nn.Module] = [nn.Conv2d(channels, 4, 3)]
    layers += [nn.BatchNorm2d(4)] if norm else []
    layers += [
        nn.MaxPool2d(2),
        snn.Leaky(beta=0.5, spike_grad=grad, init_hidden=True),
        nn.Conv2d(4, 6, 3),
        nn.MaxPool2d(2),
    ]
    layers += [nn.BatchNorm2d(6)] if norm else []
    layers += [snn.Leaky(beta=0.5, spike_grad=grad, init_hidden=True), nn.Flatten()]
    layers += [nn.Linear(6 * 2 * 2, 5), nn.Dropout(dropout)] if dropout else [nn.Linear(24, 5)]
    layers += [snn.Leaky(beta=0.5, spike_grad=grad, init_hidden=True, output=True, threshold=0.2)]
    return nn.Sequential(*layers)


def csnn_loop(net: nn.Sequential, data: Tensor) -> tuple[Tensor, Tensor]:
    """Tutorial 7's ``forward_pass``, recording spikes and membranes."""
    spk_rec, mem_rec = [], []
    snn_utils.reset(net)
    for step in range(data.size(0)):
        spk_out, mem_out = net(data[step])
        spk_rec.append(spk_out)
        mem_rec.append(mem_out)
    return torch.stack(spk_rec), torch.stack(mem_rec)


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
@pytest.mark.parametrize("norm", [False, True], ids=["tutorial6", "bn-dropout"])
def test_tutorial6_csnn(norm: bool, plan: Any, granularity: str) -> None:
    x = torch.rand(T, B, 1, 14, 14) * 4
    options = GRANULARITIES[granularity]
    route = lambda m, x: sc.wrap(m, plan=plan, output="both", **options)(x)  # noqa: E731
    name = "tutorial 6 CSNN" + (" + BatchNorm, Dropout" if norm else "")
    check(lambda: csnn(1, norm, 0.25 if norm else 0.0), csnn_loop, route, x, name)


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_tutorial7_nmnist(plan: Any, granularity: str) -> None:
    x = (torch.rand(T, B, 2, 14, 14) < 0.5).float()  # events, two polarities
    options = GRANULARITIES[granularity]
    route = lambda m, x: sc.wrap(m, plan=plan, output="both", **options)(x)  # noqa: E731
    check(lambda: csnn(2, False, 0.0), csnn_loop, route, x, "tutorial 7 N-MNIST")


# ----------------------------------------------------------------------------- regression 1, 2


class Regression1(nn.Module):
    """Regression tutorial 1: per-neuron random learnable beta and thresholds, a reset-free
    output neuron whose membrane is the output."""

    def __init__(self, timesteps: int = T, hidden: int = 8) -> None:
        super().__init__()
        self.timesteps = timesteps
        spike_grad = surrogate.fast_sigmoid()
        self.fc_in = nn.Linear(1, hidden)
        self.lif_in = snn.Leaky(
            beta=torch.rand(hidden),
            threshold=torch.rand(hidden),
            learn_beta=True,
            spike_grad=spike_grad,
        )
        self.fc_hidden = nn.Linear(hidden, hidden)
        self.lif_hidden = snn.Leaky(
            beta=torch.rand(hidden),
            threshold=torch.rand(hidden),
            learn_beta=True,
            spike_grad=spike_grad,
        )
        self.fc_out = nn.Linear(hidden, 1)
        self.li_out = snn.Leaky(
            beta=torch.rand(1),
            threshold=1.0,
            learn_beta=True,
            spike_grad=spike_grad,
            reset_mechanism="none",
        )

    def body(self, x_timestep: Tensor, mems: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        mem_1, mem_2, mem_3 = mems
        spk_in, mem_1 = self.lif_in(self.fc_in(x_timestep), mem_1)
        spk_hidden, mem_2 = self.lif_hidden(self.fc_hidden(spk_in), mem_2)
        _, mem_3 = self.li_out(self.fc_out(spk_hidden), mem_3)
        return mem_1, mem_2, mem_3

    def forward(self, x: Tensor) -> Tensor:  # before
        mems = (self.lif_in.init_leaky(), self.lif_hidden.init_leaky(), self.li_out.init_leaky())
        mem_3_rec = []
        for step in range(self.timesteps):
            mems = self.body(x[step, :, :], mems)
            mem_3_rec.append(mems[2])
        return torch.stack(mem_3_rec)

    def scanned(self, x: Tensor, plan: Any) -> Tensor:  # after
        mems = (self.lif_in.init_leaky(), self.lif_hidden.init_leaky(), self.li_out.init_leaky())

        def step(mems: tuple[Tensor, ...], x_timestep: Tensor) -> Any:
            mems = self.body(x_timestep, mems)
            return mems, mems[2]

        mem_3_rec, _ = sc.scan(step, x[: self.timesteps], mems, plan=plan)
        return mem_3_rec


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_regression1(plan: Any) -> None:
    x = torch.linspace(0, 1, T)[:, None, None].expand(T, B, 1).contiguous()
    check(Regression1, lambda m, x: m(x), lambda m, x: m.scanned(x, plan), x, "regression 1")


class Regression2(nn.Module):
    """Regression tutorial 2: ``RLeaky`` layers, ``init_rleaky()``, a static input."""

    def __init__(self, timesteps: int = T, hidden: int = 8, beta: float = 0.9) -> None:
        super().__init__()
        self.timesteps = timesteps
        self.fc1 = nn.Linear(12, hidden)
        self.rlif1 = snn.RLeaky(beta=beta, linear_features=hidden)
        self.fc2 = nn.Linear(hidden, 4)
        self.rlif2 = snn.RLeaky(beta=beta, linear_features=4)

    def forward(self, x: Tensor) -> Tensor:  # before
        spk1, mem1 = self.rlif1.init_rleaky()
        spk2, mem2 = self.rlif2.init_rleaky()
        spk_recording = []
        for _step in range(self.timesteps):
            spk1, mem1 = self.rlif1(self.fc1(x), spk1, mem1)
            spk2, mem2 = self.rlif2(self.fc2(spk1), spk2, mem2)
            spk_recording.append(spk2)
        return torch.stack(spk_recording)

    def scanned(self, x: Tensor, plan: Any) -> Tensor:  # after
        def step(state: Any, x: Tensor) -> Any:
            spk1, mem1, spk2, mem2 = state
            spk1, mem1 = self.rlif1(self.fc1(x), spk1, mem1)
            spk2, mem2 = self.rlif2(self.fc2(spk1), spk2, mem2)
            return (spk1, mem1, spk2, mem2), spk2

        state = (*self.rlif1.init_rleaky(), *self.rlif2.init_rleaky())
        xs = x.expand(self.timesteps, *x.shape)
        spk_recording, _ = sc.scan(step, xs, state, plan=plan)
        return spk_recording


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_regression2(plan: Any) -> None:
    x = torch.rand(B, 12) * 2
    check(Regression2, lambda m, x: m(x), lambda m, x: m.scanned(x, plan), x, "regression 2")


# ----------------------------------------------------------------------------- SAE


class SAE(nn.Module):
    """The spiking autoencoder tutorial: encoder, latent-to-conv and decoder ``nn.Sequential``
    of ``init_hidden`` neurons with BatchNorm, run in two loops over time."""

    def __init__(self, num_steps: int = T, latent: int = 6, thresh: float = 1.0) -> None:
        super().__init__()
        self.num_steps = num_steps
        grad = surrogate.atan(alpha=2.0)

        def leaky(**kw: Any) -> nn.Module:
            return snn.Leaky(beta=0.5, spike_grad=grad, init_hidden=True, **kw)

        self.encoder = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1, stride=2),
            nn.BatchNorm2d(4),
            leaky(threshold=thresh),
            nn.Flatten(start_dim=1, end_dim=3),
            nn.Linear(4 * 4 * 4, latent),
            leaky(output=True, threshold=thresh),
        )
        self.linearNet = nn.Sequential(
            nn.Linear(latent, 4 * 4 * 4), leaky(output=True, threshold=thresh)
        )
        self.decoder = nn.Sequential(
            nn.Unflatten(1, (4, 4, 4)),
            leaky(threshold=thresh),
            nn.ConvTranspose2d(4, 2, 3, padding=1, stride=(2, 2), output_padding=1),
            nn.BatchNorm2d(2),
            leaky(output=True, threshold=20000.0),
        )

    def forward(self, x: Tensor) -> Tensor:  # before: the tutorial's forward
        snn_utils.reset(self.encoder)
        snn_utils.reset(self.decoder)
        snn_utils.reset(self.linearNet)
        spk_rec = []
        for _step in range(self.num_steps):
            spk_x, _mem_x = self.encoder(x)
            spk_rec.append(spk_x)
        spk_rec_t = torch.stack(spk_rec, dim=2)
        spk_mem2 = []
        for step in range(self.num_steps):
            spk_x, _ = self.linearNet(spk_rec_t[..., step])
            _x_recon, x_mem_recon = self.decoder(spk_x)
            spk_mem2.append(x_mem_recon)
        return torch.stack(spk_mem2, dim=4)[:, :, :, :, -1]

    def wrapped(self, x: Tensor, plan: Any) -> Tensor:  # after: two wrapped loops
        xs = x.expand(self.num_steps, *x.shape)
        spk_rec, _mem = sc.wrap(self.encoder, plan=plan)(xs)  # what encoder(x) returned
        decode = nn.Sequential(self.linearNet, self.decoder)
        return sc.wrap(decode, plan=plan, output="mem", readout="last")(spk_rec)


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_sae(plan: Any) -> None:
    """BatchNorm in training mode in both loops: running statistics as in the loop."""
    x = torch.rand(B, 1, 8, 8)
    check(
        lambda: SAE(thresh=0.5),
        lambda m, x: m(x),
        lambda m, x: m.wrapped(x, plan),
        x,
        "SAE (BatchNorm)",
    )


# ----------------------------------------------------------------------------- BSNN


class Binarize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: Tensor) -> Tensor:
        return weight.sign().clamp(min=-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.clone()  # straight-through estimator


class BinaryConv2d(nn.Conv2d):
    def forward(self, input: Tensor) -> Tensor:
        return F.conv2d(input, Binarize.apply(self.weight), padding=self.padding)


class BinaryLinear(nn.Linear):
    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, Binarize.apply(self.weight), self.bias)


class BSNN(nn.Module):
    """The binarised SNN tutorial: binarised convolution and linear layers, BatchNorm,
    max pooling, Dropout, its own loop with a static input."""

    def __init__(self, num_steps: int = T, dropout: float = 0.3) -> None:
        super().__init__()
        self.num_steps = num_steps
        self.bin_conv_1 = BinaryConv2d(1, 4, 3, padding="same", bias=False)
        self.batch_norm_1 = nn.BatchNorm2d(4)
        self.max_pool_1 = nn.MaxPool2d(2)
        self.lif1 = snn.Leaky(beta=0.7, threshold=0.5)
        self.flatten = nn.Flatten()
        self.bin_fully_connected_1 = BinaryLinear(4 * 4 * 4, 5)
        self.dropout = nn.Dropout(dropout)
        self.lif2 = snn.Leaky(beta=0.7, threshold=1.5)

    def body(self, inpt: Tensor, mem1: Tensor, mem2: Tensor) -> tuple[Tensor, ...]:
        current1 = self.max_pool_1(self.batch_norm_1(self.bin_conv_1(inpt)))
        spike1, mem1 = self.lif1(current1, mem1)
        current2 = self.dropout(self.bin_fully_connected_1(self.flatten(spike1)))
        spike2, mem2 = self.lif2(current2, mem2)
        return spike2, mem1, mem2

    def forward(self, inpt: Tensor) -> tuple[Tensor, Tensor]:  # before
        mem1, mem2 = self.lif1.init_leaky(), self.lif2.init_leaky()
        spike2_rec, mem2_rec = [], []
        for _step in range(self.num_steps):
            spike2, mem1, mem2 = self.body(inpt, mem1, mem2)
            spike2_rec.append(spike2)
            mem2_rec.append(mem2)
        return torch.stack(spike2_rec, dim=0), torch.stack(mem2_rec, dim=0)

    def scanned(self, inpt: Tensor, plan: Any) -> tuple[Tensor, Tensor]:  # after
        def step(state: Any, inpt: Tensor) -> Any:
            spike2, mem1, mem2 = self.body(inpt, *state)
            return (mem1, mem2), (spike2, mem2)

        state = (self.lif1.init_leaky(), self.lif2.init_leaky())
        (spike2_rec, mem2_rec), _ = sc.scan(
            step, inpt.expand(self.num_steps, *inpt.shape), state, plan=plan
        )
        return spike2_rec, mem2_rec


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_bsnn(plan: Any) -> None:
    """Dropout replayed, BatchNorm's running statistics updated once per step (the step calls
    the BatchNorm module itself: scan keeps recomputation from updating it)."""
    x = torch.rand(B, 1, 8, 8) * 2
    check(BSNN, lambda m, x: m(x), lambda m, x: m.scanned(x, plan), x, "BSNN (BatchNorm, Dropout)")
