"""Fused neurons: each layer-wise chunk of a known neuron runs as one computation.

Every fused neuron type and option is checked against the framework's own step, called one
step at a time as its users call it, on the chunk's synaptic input computed as the engine
computes it (one batched ``Linear`` per chunk; the input requires grad, so the dense synapse
runs): spikes and membranes bitwise, states and gradients (input, weights, learnable neuron
parameters) at float32 round-off, over random chunk lengths, ``T`` not a multiple of the chunk,
batch sizes, outputs, and Dropout before the neuron. Neurons that cannot be fused keep the
per-step call, and ``last_stats`` says so per block.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import snntorch as snn
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from norse_cells import CobaLIFFeedForwardCell
from snn_loops import leaky_loop as _plain_loop
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.adapters.layered import VerifiedKernel

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse
    from norse.torch.functional.coba_lif import CobaLIFParameters
    from norse.torch.functional.reset import reset_subtract

Factory = Callable[[int], nn.Module]


def _custom_surrogate() -> Any:
    def fast_sigmoid(input_: Tensor, grad_input: Tensor, spikes: Tensor) -> Tensor:
        return grad_input / (10 * torch.abs(input_) + 1.0) ** 2

    return snn.surrogate.custom_surrogate(fast_sigmoid)


S = snn.surrogate
NEURONS: dict[str, Factory] = {
    "leaky": lambda n: snn.Leaky(beta=0.9),
    "leaky zero": lambda n: snn.Leaky(beta=0.8, reset_mechanism="zero"),
    "leaky none": lambda n: snn.Leaky(beta=0.7, reset_mechanism="none"),
    "leaky learnable": lambda n: snn.Leaky(
        beta=torch.rand(n) * 1.2,  # some above 1: the clamp's gradient mask matters
        learn_beta=True,
        threshold=0.7,
        learn_threshold=True,
        graded_spikes_factor=1.5,
        learn_graded_spikes_factor=True,
    ),
    "leaky zero learnable": lambda n: snn.Leaky(
        beta=0.85, learn_beta=True, reset_mechanism="zero", learn_threshold=True
    ),
    "leaky fast_sigmoid": lambda n: snn.Leaky(beta=0.9, spike_grad=S.fast_sigmoid(slope=5)),
    "leaky sigmoid": lambda n: snn.Leaky(beta=0.9, spike_grad=S.sigmoid(slope=5)),
    "leaky triangular": lambda n: snn.Leaky(beta=0.9, spike_grad=S.triangular()),
    "leaky straight_through": lambda n: snn.Leaky(
        beta=0.9, spike_grad=S.straight_through_estimator()
    ),
    "leaky spike_rate_escape": lambda n: snn.Leaky(beta=0.9, spike_grad=S.spike_rate_escape()),
    "leaky custom surrogate": lambda n: snn.Leaky(beta=0.9, spike_grad=_custom_surrogate()),
    "leaky init_hidden": lambda n: snn.Leaky(beta=0.9, init_hidden=True),
    "leaky reset_delay False": lambda n: snn.Leaky(beta=0.9, reset_delay=False),
    "leaky reset_delay False zero learnable": lambda n: snn.Leaky(
        beta=torch.rand(n) * 1.1,
        learn_beta=True,
        reset_delay=False,
        reset_mechanism="zero",
        threshold=0.7,
    ),
    "leaky reset_delay False graded fast_sigmoid": lambda n: snn.Leaky(
        beta=0.85, reset_delay=False, graded_spikes_factor=1.7, spike_grad=S.fast_sigmoid()
    ),
    "leaky reset_delay False learnable threshold graded": lambda n: snn.Leaky(
        beta=torch.rand(n),
        learn_beta=True,
        reset_delay=False,
        threshold=torch.rand(n) + 0.3,
        learn_threshold=True,
        graded_spikes_factor=1.4,
        learn_graded_spikes_factor=True,
    ),
    "leaky reset_delay False zero learnable threshold": lambda n: snn.Leaky(
        beta=0.9, reset_delay=False, reset_mechanism="zero", threshold=0.6, learn_threshold=True
    ),
    "synaptic": lambda n: snn.Synaptic(alpha=0.8, beta=0.9),
    "synaptic zero": lambda n: snn.Synaptic(alpha=0.7, beta=0.9, reset_mechanism="zero"),
    "synaptic none": lambda n: snn.Synaptic(alpha=0.7, beta=0.8, reset_mechanism="none"),
    "synaptic learnable": lambda n: snn.Synaptic(
        alpha=torch.rand(n),
        beta=torch.rand(n) * 1.1,
        learn_alpha=True,
        learn_beta=True,
        threshold=0.8,
        learn_threshold=True,
    ),
    "alpha": lambda n: snn.Alpha(alpha=0.9, beta=0.8, threshold=0.5),
    "alpha subtract": lambda n: snn.Alpha(
        alpha=0.85, beta=0.6, threshold=0.4, reset_mechanism="subtract"
    ),
    "alpha none": lambda n: snn.Alpha(alpha=0.9, beta=0.7, reset_mechanism="none"),
    "alpha learnable subtract": lambda n: snn.Alpha(
        alpha=torch.rand(n) * 0.1 + 0.88,  # per neuron, above beta
        beta=torch.rand(n) * 0.8,
        learn_beta=True,
        threshold=0.5,
        learn_threshold=True,
        reset_mechanism="subtract",
    ),
    "alpha learnable zero": lambda n: snn.Alpha(
        alpha=0.9, beta=0.75, learn_beta=True, learn_threshold=True, threshold=0.6
    ),
    "rleaky": lambda n: snn.RLeaky(beta=0.9, linear_features=n),
    "rleaky zero learnable": lambda n: snn.RLeaky(
        beta=torch.rand(n) * 1.1,
        learn_beta=True,
        linear_features=n,
        reset_mechanism="zero",
        threshold=0.7,
        learn_threshold=True,
    ),
    "rleaky none fast_sigmoid": lambda n: snn.RLeaky(
        beta=0.8, linear_features=n, reset_mechanism="none", spike_grad=S.fast_sigmoid()
    ),
    "rleaky one-to-one": lambda n: snn.RLeaky(beta=0.85, all_to_all=False, V=torch.rand(n)),
    "rleaky one-to-one fixed init_hidden": lambda n: snn.RLeaky(
        beta=0.9, all_to_all=False, V=0.5, learn_recurrent=False, init_hidden=True
    ),
    "rsynaptic": lambda n: snn.RSynaptic(alpha=0.8, beta=0.9, linear_features=n),
    "rsynaptic zero learnable": lambda n: snn.RSynaptic(
        alpha=torch.rand(n),
        beta=torch.rand(n) * 1.1,
        learn_alpha=True,
        learn_beta=True,
        linear_features=n,
        reset_mechanism="zero",
        threshold=0.7,
        learn_threshold=True,
    ),
    "rsynaptic one-to-one none init_hidden": lambda n: snn.RSynaptic(
        alpha=0.9,
        beta=0.8,
        all_to_all=False,
        V=torch.rand(n),
        reset_mechanism="none",
        init_hidden=True,
    ),
    "lapicque": lambda n: snn.Lapicque(beta=0.9),
    "lapicque RC zero": lambda n: snn.Lapicque(R=5.0, C=0.1, reset_mechanism="zero"),
    "lapicque none learnable": lambda n: snn.Lapicque(
        beta=0.9, reset_mechanism="none", learn_threshold=True
    ),
    "norse lif": lambda n: norse.LIFCell(),
    "norse lif tanh": lambda n: norse.LIFCell(
        norse.LIFParameters(method="tanh", v_th=torch.tensor(0.4))
    ),
    "norse lif learnable": lambda n: norse.LIFCell(
        norse.LIFParameters(
            tau_mem_inv=nn.Parameter(torch.full((n,), 80.0)),
            tau_syn_inv=nn.Parameter(torch.tensor(150.0)),
            v_leak=nn.Parameter(torch.tensor(0.1)),
            v_th=nn.Parameter(torch.tensor(0.5)),
            v_reset=nn.Parameter(torch.tensor(-0.1)),
        )
    ),
    "norse lif recurrent": lambda n: norse.LIFRecurrentCell(n, n),
    "norse lif recurrent tanh autapses": lambda n: norse.LIFRecurrentCell(
        n, n, p=norse.LIFParameters(method="tanh", v_th=torch.tensor(0.4)), autapses=True
    ),
    "norse lif recurrent learnable": lambda n: norse.LIFRecurrentCell(
        n,
        n,
        p=norse.LIFParameters(
            tau_mem_inv=nn.Parameter(torch.full((n,), 80.0)),
            tau_syn_inv=nn.Parameter(torch.tensor(150.0)),
            v_leak=nn.Parameter(torch.tensor(0.1)),
            v_th=nn.Parameter(torch.tensor(0.5)),
            v_reset=nn.Parameter(torch.tensor(-0.1)),
        ),
    ),
    "norse lsnn": lambda n: norse.LSNNCell(),
    "norse lsnn tanh adapting": lambda n: norse.LSNNCell(
        norse.LSNNParameters(
            method="tanh",
            tau_adapt_inv=torch.tensor(60.0),
            v_th=torch.tensor(0.4),
            beta=torch.tensor(0.5),
            v_reset=torch.tensor(-0.1),
        )
    ),
    "norse lsnn per-neuron": lambda n: norse.LSNNCell(
        norse.LSNNParameters(beta=torch.linspace(1.0, 2.0, n), v_th=torch.linspace(0.4, 0.6, n))
    ),
    "norse lsnn recurrent": lambda n: norse.LSNNRecurrentCell(n, n),
    "norse lsnn recurrent tanh autapses adapting": lambda n: norse.LSNNRecurrentCell(
        n,
        n,
        p=norse.LSNNParameters(
            method="tanh",
            tau_adapt_inv=torch.tensor(60.0),
            v_th=torch.tensor(0.4),
            beta=torch.tensor(0.5),
            v_reset=torch.tensor(-0.1),
        ),
        autapses=True,
    ),
    "norse lifex": lambda n: norse.LIFExCell(),
    "norse lifex tanh sharp": lambda n: norse.LIFExCell(
        norse.LIFExParameters(
            method="tanh",
            delta_T=torch.full((n,), 0.2),
            v_th=torch.tensor(0.6),
            v_reset=torch.tensor(-0.1),
        )
    ),
    "norse lifadex": lambda n: norse.LIFAdExCell(),
    "norse lifadex triangle adapting": lambda n: norse.LIFAdExCell(
        norse.LIFAdExParameters(
            method="triangle",
            adaptation_current=torch.tensor(20.0),
            adaptation_spike=torch.linspace(0.5, 3.0, n),
            tau_ada_inv=torch.tensor(50.0),
            delta_T=torch.tensor(1.5),
            v_reset=torch.tensor(-0.2),
        )
    ),
    "norse lifex recurrent": lambda n: norse.LIFExRecurrentCell(n, n),
    "norse lifadex recurrent triangle autapses": lambda n: norse.LIFAdExRecurrentCell(
        n,
        n,
        p=norse.LIFAdExParameters(
            method="triangle",
            adaptation_spike=torch.linspace(0.5, 3.0, n),
            tau_ada_inv=torch.tensor(50.0),
        ),
        autapses=True,
    ),
    "norse izhikevich": lambda n: norse.IzhikevichCell(_fast_izhikevich(n, per_neuron=False)),
    "norse izhikevich tanh per-neuron": lambda n: norse.IzhikevichCell(
        _fast_izhikevich(n, per_neuron=True)
    ),
    "norse lifrefrac": lambda n: norse.LIFRefracCell(),
    "norse lifrefrac tanh short per-neuron": lambda n: norse.LIFRefracCell(
        norse.LIFRefracParameters(
            norse.LIFParameters(
                method="tanh",
                v_th=torch.tensor(0.4),
                v_reset=torch.linspace(-0.2, 0.1, n),
                tau_mem_inv=torch.tensor(150.0),
            ),
            rho_reset=torch.linspace(0.5, 3.5, n),  # fractional: relu's gate at 0
        )
    ),
    "norse lifadexrefrac": lambda n: norse.LIFAdExRefracCell(),
    "norse lifadexrefrac triangle adapting per-neuron": lambda n: norse.LIFAdExRefracCell(
        norse.LIFAdExRefracParameters(
            norse.LIFAdExParameters(
                method="triangle",
                adaptation_current=torch.tensor(20.0),
                adaptation_spike=torch.linspace(0.5, 3.0, n),
                tau_ada_inv=torch.tensor(50.0),
                delta_T=torch.tensor(1.5),
                v_reset=torch.linspace(-0.2, 0.1, n),
            ),
            rho_reset=torch.linspace(0.5, 3.5, n),  # fractional: relu's gate at 0
        )
    ),
    "norse lifrefrac recurrent": lambda n: norse.LIFRefracRecurrentCell(n, n),
    "norse lifrefrac recurrent triangle autapses short": lambda n: norse.LIFRefracRecurrentCell(
        n,
        n,
        p=norse.LIFRefracParameters(
            norse.LIFParameters(method="triangle", v_th=torch.tensor(0.4)),
            rho_reset=torch.linspace(0.5, 3.5, n),
        ),
        autapses=True,
    ),
    "norse lifadexrefrac recurrent": lambda n: norse.LIFAdExRefracRecurrentCell(n, n),
    "norse lifbox": lambda n: norse.LIFBoxCell(),
    "norse lifbox subtract": lambda n: norse.LIFBoxCell(
        norse.LIFBoxParameters(
            reset_method=reset_subtract,
            v_th=nn.Parameter(torch.tensor(0.4)),
            tau_mem_inv=nn.Parameter(torch.tensor(90.0)),
        )
    ),
    # fresh tensors: Norse's IAFCell.initial_state makes v_reset take a gradient, and the
    # default IAFParameters() is one object shared by every IAFCell() (its .grad would add up)
    "norse iaf": lambda n: norse.IAFCell(
        norse.IAFParameters(v_th=torch.tensor(1.0), v_reset=torch.tensor(0.0))
    ),
    "norse iaf tanh learnable": lambda n: norse.IAFCell(
        norse.IAFParameters(
            v_th=nn.Parameter(torch.linspace(0.6, 1.2, n)),
            v_reset=torch.tensor(-0.2),
            method="tanh",
            alpha=torch.tensor(20.0),
        )
    ),
    "norse libox": lambda n: norse.LIBoxCell(),
    "norse libox learnable": lambda n: norse.LIBoxCell(
        norse.LIBoxParameters(
            tau_mem_inv=nn.Parameter(torch.full((n,), 80.0)),
            v_leak=nn.Parameter(torch.tensor(0.1)),
        )
    ),
    "norse coba": lambda n: CobaLIFFeedForwardCell(),
    "norse coba triangle fast": lambda n: CobaLIFFeedForwardCell(
        CobaLIFParameters(
            method="triangle",
            alpha=0.5,
            c_m_inv=torch.tensor(40.0),
            tau_syn_exc_inv=torch.linspace(50.0, 200.0, n),
            tau_syn_inh_inv=torch.tensor(100.0),
            v_reset=torch.tensor(-30.0),
        ),
        dt=0.002,
    ),
    "norse li": lambda n: norse.LICell(),
    # Python numbers: LIParameters and LIFBoxParameters keep them as given
    "norse li numbers": lambda n: norse.LICell(
        norse.LIParameters(tau_mem_inv=90.0, tau_syn_inv=150)
    ),
    "norse lifbox numbers": lambda n: norse.LIFBoxCell(
        norse.LIFBoxParameters(tau_mem_inv=90.0, v_th=0.4, v_reset=-0.1)
    ),
    "norse li learnable": lambda n: norse.LICell(
        norse.LIParameters(
            tau_mem_inv=nn.Parameter(torch.tensor(90.0)),
            tau_syn_inv=nn.Parameter(torch.full((n,), 150.0)),
            v_leak=nn.Parameter(torch.tensor(0.2)),
        )
    ),
}


def _fast_izhikevich(n: int, per_neuron: bool) -> Any:
    """Norse's ``tonic_spiking`` 16 times as fast (``tau_inv`` 4000) from -56 mV: the
    table's inputs make a third of the neurons fire each step; per-neuron ``b`` and ``d`` and
    the ``tanh`` surrogate with ``per_neuron``."""
    if not per_neuron:
        p = norse.IzhikevichParameters(a=0.02, b=0.2, c=-65, d=6, tau_inv=4000)
    else:
        p = norse.IzhikevichParameters(
            a=0.02,
            b=torch.linspace(0.15, 0.25, n),
            c=torch.tensor(-60.0),
            d=torch.linspace(2.0, 8.0, n),
            tau_inv=4000,
            method="tanh",
            alpha=0.5,
        )
    v = torch.tensor(-56.0)
    return norse.IzhikevichSpikingBehavior(p, norse.IzhikevichState(v=v, u=v * 0.2))


def _is_norse(neuron: nn.Module) -> bool:
    return type(neuron).__module__.startswith("norse")


def _neuron_params(neuron: nn.Module) -> list[Tensor]:
    found = [p for p in neuron.parameters() if p.requires_grad]
    if _is_norse(neuron):
        found += [t for t in neuron.p if isinstance(t, Tensor) and t.requires_grad]
    return found


def _framework_loop(
    net: nn.Sequential, x: Tensor, chunk: int
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The framework's own step, called per step as its users do, on the synaptic input of
    each chunk computed as the engine does (one Linear (+ Dropout) call per chunk):
    ``(spikes (T, B, n), membranes (T, B, n), final state leaves)``."""
    *synapse, neuron = net
    T, B = x.shape[:2]
    state: Any = None
    spikes, mems = [], []
    for t0 in range(0, T, chunk):
        xc = x[t0 : t0 + chunk]
        z = xc.reshape(-1, xc.shape[-1])
        for layer in synapse:
            z = layer(z)
        z = z.reshape(xc.shape[0], B, -1)
        for z_t in z.unbind(0):
            if _is_norse(neuron):
                y, state = neuron(z_t, state)
                # LIFRefracCell's: state.lif.v; LIFAdExRefracCell's: state.lif_adex.v
                mem = getattr(state, "lif", getattr(state, "lif_adex", state)).v
            elif isinstance(neuron, snn.Synaptic):
                if state is None:
                    state = (torch.zeros_like(z_t), torch.zeros_like(z_t))
                y, syn, mem = neuron(z_t, *state)
                state = (syn, mem)
            elif isinstance(neuron, snn.RSynaptic) and neuron.init_hidden:
                y = neuron(z_t)
                mem = neuron.mem
                state = (neuron.spk, neuron.syn, mem)
            elif isinstance(neuron, snn.RSynaptic):
                if state is None:
                    state = tuple(torch.zeros_like(z_t) for _ in range(3))
                y, syn, mem = neuron(z_t, *state)
                state = (y, syn, mem)
            elif isinstance(neuron, snn.RLeaky) and neuron.init_hidden:
                y = neuron(z_t)
                mem = neuron.mem
                state = (neuron.spk, mem)
            elif isinstance(neuron, snn.RLeaky):
                if state is None:
                    state = (torch.zeros_like(z_t), torch.zeros_like(z_t))
                y, mem = neuron(z_t, *state)
                state = (y, mem)
            elif isinstance(neuron, snn.Alpha):
                if state is None:
                    state = tuple(torch.zeros_like(z_t) for _ in range(3))
                y, exc, inh, mem = neuron(z_t, *state)
                state = (exc, inh, mem)
            elif neuron.init_hidden:
                y = neuron(z_t)
                mem = neuron.mem
                state = (mem,)
            else:
                y, mem = neuron(z_t, state[0] if state else torch.zeros_like(z_t))
                state = (mem,)
            spikes.append(y)
            mems.append(mem)
    if not _is_norse(neuron) and neuron.init_hidden:
        neuron.reset_mem()
    leaves = torch.utils._pytree.tree_leaves(state)  # Norse's may nest (LIFRefracCell)
    return torch.stack(spikes), torch.stack(mems), leaves


def _grads(out: Tensor, wrt: list[Tensor]) -> list[Tensor | None]:
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    return list(torch.autograd.grad((out * weights).sum(), wrt, allow_unused=True))


def _close(a: Tensor | None, b: Tensor | None, what: str) -> None:
    if a is None or b is None:
        assert a is None or not a.abs().gt(0).any(), what
        assert b is None or not b.abs().gt(0).any(), what
        return
    finite = a[a.isfinite()]  # a surrogate can overflow (snnTorch's sigmoid: inf / inf)
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-6 * (1 + scale), equal_nan=True, msg=what)


#: a fused neuron's random case besides its name: steps, chunk, batch, neurons, what the
#: wrapped model returns, a Dropout before the neuron, the seed
_CASES: dict[str, st.SearchStrategy[Any]] = {
    "T": st.integers(1, 23),
    "chunk": st.integers(1, 26),
    "batch": st.integers(1, 3),
    "n": st.integers(1, 5),
    "output": st.sampled_from(["spikes", "mem", "both"]),
    "dropout": st.booleans(),
    "seed": st.integers(0, 2**16),
}


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(name=st.sampled_from(sorted(NEURONS)), **_CASES)
def test_fused_neurons_match_the_frameworks_own_step(
    name: str, T: int, chunk: int, batch: int, n: int, output: str, dropout: bool, seed: int
) -> None:
    torch.manual_seed(seed)
    n_in = 4
    layers: list[nn.Module] = [nn.Linear(n_in, n)]
    if dropout:
        layers.append(nn.Dropout(0.3))
    net = nn.Sequential(*layers, NEURONS[name](n))
    with torch.no_grad():
        net[0].weight.mul_(3.0)
    x = ((torch.rand(T, batch, n_in) < 0.5).float() * 1.5).requires_grad_()
    wrt = [x, *net[0].parameters(), *_neuron_params(net[-1])]
    k = min(chunk, T)

    torch.manual_seed(seed + 1)
    spikes, mems, final = _framework_loop(net, x, k)
    want = {"spikes": spikes, "mem": mems, "both": torch.cat([spikes, mems], -1)}[output]
    want_grads = _grads(want, wrt)  # (spikes without a gradient step per call: not here)

    torch.manual_seed(seed + 1)
    seq = sc.wrap(net, granularity="layer", chunk=k, output=output)
    got, got_final = seq(x, return_state=True)
    got = torch.cat(got, -1) if output == "both" else got
    # Norse's LSNN over T = 1: its input reaches no spike, the loop's graph gives the layers
    # below no gradient path: per step (`spikeckpt.engine.layerwise`)
    ran = "per-step" if T == 1 and "lsnn" in name else "fused"
    assert seq.last_stats.blocks[0].neuron == ran, seq.last_stats.blocks[0].neuron_chunks
    assert torch.equal(got.detach(), want.detach()), name
    got_leaves = [t for t in torch.utils._pytree.tree_leaves(got_final)]
    for a, b in zip(final, got_leaves[-len(final) :], strict=True):
        _close(a.detach().expand_as(b), b.detach(), f"{name}: final state")
    got_grads = _grads(got, wrt)
    for i, (a, b) in enumerate(zip(want_grads, got_grads, strict=True)):
        try:
            _close(a, b, f"{name}: gradient {i}")
        except AssertionError:
            _no_farther_from_float64(net, x, k, output, i, a, b, f"{name}: gradient {i}")


def _no_farther_from_float64(
    net: nn.Module, x: Tensor, k: int, output: str, i: int, loop: Tensor, fused: Tensor, what: str
) -> None:
    """Where a gradient is a sum whose terms cancel (a threshold's), float32 round-off can
    exceed `_close`'s tolerance: then the fused gradient ``i`` must be no farther from the
    same loop's in float64 (same spikes) than the float32 loop is, plus float32's epsilon
    (a non-finite value where float64's is finite counting as infinitely far)."""
    double = copy.deepcopy(net).double()
    x64 = x.detach().double().requires_grad_()
    wrt = [x64, *double[0].parameters(), *_neuron_params(double[-1])]
    spikes, mems, _ = _framework_loop(double, x64, k)
    out = {"spikes": spikes, "mem": mems, "both": torch.cat([spikes, mems], -1)}[output]
    truth = _grads(out, wrt)[i]
    assert truth is not None, what
    # a gradient that overflowed to inf or nan where the float64 one is finite (an exploding
    # gradient: the loop's float32 order of operations may overflow where the kernel's does
    # not) is infinitely far from it
    loop_err = float((loop.double() - truth).abs().nan_to_num(nan=math.inf).max())
    fused_err = float((fused.double() - truth).abs().nan_to_num(nan=math.inf).max())
    eps = 1.2e-7 * float(truth.abs().max())
    assert fused_err <= 2 * loop_err + eps, f"{what}: {fused_err} from float64, the loop {loop_err}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(n for n in NEURONS if "reset_delay False" in n)), **_CASES)
def test_leaky_without_reset_delay_matches_snntorchs_own_step(
    name: str, T: int, chunk: int, batch: int, n: int, output: str, dropout: bool, seed: int
) -> None:
    """``Leaky(reset_delay=False)`` (`ImmediateLeakyKernel`: the reset in the step that
    fires, differentiated through the surrogate) against snnTorch's own step, more cases than
    the table's share: spikes and membranes bitwise, gradients at round-off."""
    test_fused_neurons_match_the_frameworks_own_step.hypothesis.inner_test(  # type: ignore[attr-defined]
        name=name, T=T, chunk=chunk, batch=batch, n=n, output=output, dropout=dropout, seed=seed
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(n for n in NEURONS if n.startswith("alpha"))), **_CASES)
def test_alpha_matches_snntorchs_own_step(
    name: str, T: int, chunk: int, batch: int, n: int, output: str, dropout: bool, seed: int
) -> None:
    """snnTorch ``Alpha`` (`AlphaKernel`: two synaptic currents, the membrane made from them,
    every reset, learnable ``beta`` and threshold) against snnTorch's own step: spikes and
    membranes bitwise, gradients at round-off."""
    test_fused_neurons_match_the_frameworks_own_step.hypothesis.inner_test(  # type: ignore[attr-defined]
        name=name, T=T, chunk=chunk, batch=batch, n=n, output=output, dropout=dropout, seed=seed
    )


#: the neurons with recurrent weights inside
_RECURRENT = (
    *("rleaky", "rsynaptic", "norse lif recurrent", "norse lsnn recurrent"),
    *("norse lifex recurrent", "norse lifadex recurrent"),
    *("norse lifrefrac recurrent", "norse lifadexrefrac recurrent"),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(n for n in NEURONS if n.startswith(_RECURRENT))), **_CASES)
def test_recurrent_neurons_match_the_frameworks_own_step(
    name: str, T: int, chunk: int, batch: int, n: int, output: str, dropout: bool, seed: int
) -> None:
    """snnTorch ``RLeaky`` and ``RSynaptic`` (`RecurrentKernel`: the previous spikes fed back
    through the recurrent ``Linear`` or one-to-one ``V`` inside the neuron, every reset,
    learnable ``alpha``, ``beta``, threshold and recurrent weights) and Norse's
    ``LIFRecurrentCell`` (`NorseRecurrentKernel`: input and recurrent weights inside the cell)
    ``LSNNRecurrentCell`` (`NorseLSNNKernel`: its threshold adapting too),
    ``LIFExRecurrentCell`` and ``LIFAdExRecurrentCell`` (`NorseExRecurrentKernel`),
    ``LIFRefracRecurrentCell`` and ``LIFAdExRefracRecurrentCell``
    (`NorseRefracRecurrentKernel`) against the framework's own step: spikes and membranes
    bitwise, gradients at round-off."""
    test_fused_neurons_match_the_frameworks_own_step.hypothesis.inner_test(  # type: ignore[attr-defined]
        name=name, T=T, chunk=chunk, batch=batch, n=n, output=output, dropout=dropout, seed=seed
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(n for n in NEURONS if "lsnn" in n)), **_CASES)
def test_lsnn_neurons_match_norses_own_step(
    name: str, T: int, chunk: int, batch: int, n: int, output: str, dropout: bool, seed: int
) -> None:
    """Norse's ``LSNNCell`` (`NorseLSNNFeedForwardKernel`: the spike's gradient through the
    reset and the adaptation too, as Norse leaves it attached) and ``LSNNRecurrentCell``
    (`NorseLSNNKernel`) against Norse's own step: spikes and membranes bitwise, gradients at
    round-off."""
    test_fused_neurons_match_the_frameworks_own_step.hypothesis.inner_test(  # type: ignore[attr-defined]
        name=name, T=T, chunk=chunk, batch=batch, n=n, output=output, dropout=dropout, seed=seed
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(n for n in NEURONS if "lifex" in n or "lifadex" in n)), **_CASES)
def test_exponential_lif_neurons_match_norses_own_step(
    name: str, T: int, chunk: int, batch: int, n: int, output: str, dropout: bool, seed: int
) -> None:
    """Norse's ``LIFExCell`` and ``LIFAdExCell`` (`NorseExKernel`: the exponential term, the
    adaptation current, the spike's gradient through the reset and the adaptation as Norse
    leaves it attached), default and other parameters (another surrogate, per-neuron fields,
    an adapting membrane) against Norse's own step: spikes and membranes bitwise, gradients at
    round-off."""
    test_fused_neurons_match_the_frameworks_own_step.hypothesis.inner_test(  # type: ignore[attr-defined]
        name=name, T=T, chunk=chunk, batch=batch, n=n, output=output, dropout=dropout, seed=seed
    )


#: the names of neurons of `simple_kernels`
_SIMPLE = ("norse iaf", "norse libox", "norse coba")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(n for n in NEURONS if n.startswith(_SIMPLE))), **_CASES)
def test_iaf_libox_and_coba_neurons_match_norses_own_step(
    name: str, T: int, chunk: int, batch: int, n: int, output: str, dropout: bool, seed: int
) -> None:
    """Norse's ``IAFCell``, ``LIBoxCell`` and ``coba_lif_feed_forward_step``
    (`simple_kernels`: the jump, the box leak, the conductances' jumps by the input's positive
    and negative parts and their decay, the spike's gradient through the reset), default and
    other parameters (another surrogate, per-neuron and learnable fields) against Norse's own
    step: spikes and membranes bitwise, gradients at round-off."""
    test_fused_neurons_match_the_frameworks_own_step.hypothesis.inner_test(  # type: ignore[attr-defined]
        name=name, T=T, chunk=chunk, batch=batch, n=n, output=output, dropout=dropout, seed=seed
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(n for n in NEURONS if n.endswith("numbers"))), **_CASES)
def test_python_numbers_in_norses_parameters_match_norses_own_step(
    name: str, T: int, chunk: int, batch: int, n: int, output: str, dropout: bool, seed: int
) -> None:
    """``LICell`` and ``LIFBoxCell`` with Python numbers in ``p`` (``LIParameters`` and
    ``LIFBoxParameters`` keep them as given; such a cell ran per step): spikes and membranes
    bitwise Norse's own step, gradients at round-off."""
    test_fused_neurons_match_the_frameworks_own_step.hypothesis.inner_test(  # type: ignore[attr-defined]
        name=name, T=T, chunk=chunk, batch=batch, n=n, output=output, dropout=dropout, seed=seed
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(n for n in NEURONS if "izhikevich" in n or "refrac" in n)), **_CASES
)
def test_izhikevich_and_refractory_neurons_match_norses_own_step(
    name: str, T: int, chunk: int, batch: int, n: int, output: str, dropout: bool, seed: int
) -> None:
    """Norse's ``IzhikevichCell`` (`NorseIzhikevichKernel`: the quadratic membrane, the
    recovery variable and both resets passing the spike's gradient), ``LIFRefracCell``
    (`NorseRefracKernel`: the refractory mask's gradient through ``threshold(rho)``, the
    counter's through the spike, as Norse leaves them attached), ``LIFAdExRefracCell``
    (`NorseAdExRefracKernel`) and the recurrent refractory cells
    (`NorseRefracRecurrentKernel`), default and other
    parameters (another surrogate, per-neuron fields, a fractional refractory period)
    against Norse's own step: spikes and membranes bitwise, gradients at round-off."""
    test_fused_neurons_match_the_frameworks_own_step.hypothesis.inner_test(  # type: ignore[attr-defined]
        name=name, T=T, chunk=chunk, batch=batch, n=n, output=output, dropout=dropout, seed=seed
    )


#: neurons with recurrent weights whose kernels keep torch's products and compile the rest of
#: a step (`recurrent_host`), by the name of that step
_RECURRENT_STEPS = {
    "norse lif recurrent": "lif_recurrent_step_jit",
    "rleaky": "recurrent_leaky_step_jit",
    "rsynaptic": "recurrent_leaky_step_jit",
    "norse lsnn recurrent": "lsnn_recurrent_step_jit",
}

#: neurons whose kernel runs the torch loop only (no compiled loop in `jit_loops`)
_TORCH_LOOP_ONLY = (
    *("reset_delay False", "alpha", "rleaky", "rsynaptic", "recurrent", "lsnn"),
    *("lifex", "lifadex", "iaf", "libox", "coba"),
    *("izhikevich", "lifrefrac"),
)


@pytest.mark.parametrize(
    "name",
    sorted(
        n
        for n in NEURONS
        if n.startswith(tuple(_RECURRENT_STEPS)) or not any(part in n for part in _TORCH_LOOP_ONLY)
    ),
)
def test_every_fused_neuron_runs_the_compiled_loop_bitwise_as_the_torch_loop(name: str) -> None:
    """Every neuron of the table with a compiled loop (Numba, `jit_loops`; all but Leaky's
    ``reset_delay=False`` and ``Alpha``, whose kernels run the torch loop; for ``RLeaky``,
    ``RSynaptic`` and Norse's ``LIFRecurrentCell`` and ``LSNNRecurrentCell`` the compiled part
    of each step between torch's products, `recurrent_host`) with the compiled loops on and off:
    outputs, membranes, final states and gradients bitwise equal, 3 x 100 neurons a step (a
    block of 256 and a part), chunks of 3 over 7 steps (a carry between chunks and a short last
    chunk), and the compiled forward called for every chunk."""
    from spikeckpt.adapters import host_loops, jit_loops

    family = "norse" if name.startswith("norse") else name.split()[0]
    family = {"lapicque": "leaky", "norse": "norse", "synaptic": "synaptic"}.get(family, "leaky")
    forward_name = f"{family}_forward_jit"
    for start, step_name in _RECURRENT_STEPS.items():
        if name.startswith(start):
            forward_name = step_name
    compiled = getattr(jit_loops, forward_name)
    runs = []
    for use_jit in (True, False):
        torch.manual_seed(5)
        n = 100
        net = nn.Sequential(nn.Linear(4, n), NEURONS[name](n))
        with torch.no_grad():
            net[0].weight.mul_(3.0)
        x = ((torch.rand(7, 3, 4) < 0.5).float() * 1.5).requires_grad_()
        wrt = [x, *net[0].parameters(), *_neuron_params(net[-1])]
        calls = []

        def counting(*args: Any, _compiled: Any = compiled, _calls: list = calls) -> None:
            _calls.append(1)
            _compiled(*args)

        previous = host_loops.USE_JIT
        host_loops.USE_JIT = use_jit
        setattr(jit_loops, forward_name, counting)
        try:
            seq = sc.wrap(net, granularity="layer", chunk=3, output="both")
            (spikes, mems), final = seq(x, return_state=True)
            out = torch.cat([spikes, mems], -1)
            grads = _grads(out, wrt) if out.requires_grad else []
        finally:
            host_loops.USE_JIT = previous
            setattr(jit_loops, forward_name, compiled)
        assert seq.last_stats.blocks[0].neuron == "fused"
        assert len(calls) >= (3 if use_jit else 0) and (use_jit or not calls), calls
        leaves = torch.utils._pytree.tree_leaves(final)
        runs.append((out.detach(), [t.detach() for t in leaves], grads))
    (out_a, final_a, grads_a), (out_b, final_b, grads_b) = runs

    def same(a: Tensor | None, b: Tensor | None) -> None:  # bitwise, NaN where NaN (sigmoid)
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    same(out_a, out_b)
    for pair in (*zip(final_a, final_b, strict=True), *zip(grads_a, grads_b, strict=True)):
        same(*pair)


def _quantize(mem: Tensor) -> Tensor:
    """A state quantizer (snnTorch's ``state_quant`` option): to steps of 1/64."""
    return torch.round(mem * 64) / 64


def test_stats_say_how_each_neuron_ran() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(4, 6),
        snn.Leaky(beta=0.9),
        nn.Linear(6, 6),
        snn.RSynaptic(alpha=0.8, beta=0.9, linear_features=6),  # fused, recurrent weights
        nn.Linear(6, 3),
        # an option the kernel does not model: state quantization
        snn.Leaky(beta=0.9, state_quant=_quantize),
    )
    x = (torch.rand(10, 2, 4) < 0.5).float()
    seq = sc.wrap(net, granularity="layer", chunk=4)
    seq(x).sum().backward()
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused", "per-step"]
    assert seq.last_stats.blocks[0].neuron_chunks == {"fused": 3}
    seq = sc.wrap(net, granularity="layer", chunk=4, fuse=False)
    seq(x).sum().backward()
    assert {b.neuron for b in seq.last_stats.blocks} == {"per-step"}


@pytest.mark.parametrize(
    "neuron",
    [
        snn.Leaky(beta=0.9, spike_grad=snn.surrogate.SSO()),  # draws random numbers
        snn.Leaky(beta=0.9, inhibition=True),
        snn.RLeaky(beta=0.9, linear_features=5, reset_delay=False),
        norse.IzhikevichRecurrentCell(5, 5, norse.tonic_spiking),
    ],
    ids=["SSO surrogate", "inhibition", "RLeaky reset_delay False", "norse recurrent"],
)
def test_neurons_that_cannot_be_fused_keep_the_per_step_call(neuron: nn.Module) -> None:
    net = nn.Sequential(nn.Linear(4, 5), neuron)
    x = (torch.rand(8, 2, 4) < 0.5).float()
    seq = sc.wrap(net, granularity="layer", chunk=3)
    seq(x)
    assert seq.last_stats.blocks[0].neuron == "per-step"


def _halved(y: Tensor) -> Tensor:
    return y * 0.5


def _wrong_past_the_first_sample(y: Tensor) -> Tensor:
    return torch.cat([y[:, :1], y[:, 1:] * 0.5], 1)


@pytest.mark.parametrize(
    "tamper", [_halved, _wrong_past_the_first_sample], ids=lambda f: f.__name__
)
def test_a_kernel_that_disagrees_with_the_step_is_never_used(
    tamper: Callable[[Tensor], Tensor],
) -> None:
    """A kernel whose outputs differ from the step's is never used, even one wrong only past
    the first sample: the check runs `CHECK_ROWS` samples over `CHECK_STEPS` steps (before:
    one sample over 4 steps, which often never spiked, and that kernel was used)."""
    from spikeckpt.adapters.layered import CHECK_ROWS, CHECK_STEPS

    assert CHECK_ROWS > 1 and CHECK_STEPS > 4
    net = nn.Sequential(nn.Linear(4, 5), snn.Leaky(beta=0.9))
    seq = sc.wrap(net, granularity="layer", chunk=6)
    block = seq.layer_blocks(True)[0]
    assert isinstance(block.fused, VerifiedKernel)
    kernel = block.fused.kernel
    real = kernel.forward

    def tampered(*args: Any) -> Any:
        final, y, mem, saved = real(*args)
        return final, tamper(y), mem, saved

    kernel.forward = tampered  # type: ignore[method-assign]
    x = (torch.rand(12, 3, 4) < 0.5).float()
    y = seq(x)
    assert seq.last_stats.blocks[0].neuron == "per-step" and block.fused.verified is False
    torch.testing.assert_close(y, sc.wrap(net, granularity="layer", chunk=6, fuse=False)(x))


def test_a_state_the_step_widens_runs_per_step_until_it_is_wide() -> None:
    """A float64 decay widens a float32 membrane at the first step: that chunk runs one step
    at a time (the kernel never changes a state's dtype), later chunks fused; the same
    result as one call per step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), snn.Leaky(beta=torch.tensor([0.9] * 5).double()))
    x = (torch.rand(6, 2, 4) < 0.5).float().requires_grad_()
    seq = sc.wrap(net, granularity="layer", chunk=3)
    y = seq(x)
    assert seq.last_stats.blocks[0].neuron_chunks == {"per-step": 1, "fused": 1}
    want = sc.wrap(net, granularity="layer", chunk=3, fuse=False)(x)
    assert torch.equal(y, want)
    g, g_want = (torch.autograd.grad(v.sum(), [x, net[0].weight]) for v in (y, want))
    for a, b in zip(g, g_want, strict=True):
        torch.testing.assert_close(a, b)


def test_the_one_comparison_spike_is_used_only_while_subnormals_are_kept() -> None:
    """``mem > thr`` replaces ``mem - thr > 0`` only where they agree on every float: not
    while the CPU flushes subnormal results to zero, where a subnormal difference is 0."""
    from spikeckpt.adapters.kernels import _subtraction_is_exact

    cpu = torch.device("cpu")
    assert _subtraction_is_exact(cpu)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        assert not _subtraction_is_exact(cpu)
        mem = torch.tensor([[1.5e-38, 1.4e-38, 2.0]])
        net = nn.Sequential(nn.Identity(), snn.Leaky(beta=0.0, threshold=1.4e-38))
        x = mem.expand(3, 1, 3).contiguous()
        fused = sc.wrap(net, granularity="layer", chunk=3)(x)
        plain = sc.wrap(net, granularity="layer", chunk=3, fuse=False)(x)
        assert torch.equal(fused, plain)
    finally:
        torch.set_flush_denormal(False)


@settings(max_examples=25, deadline=None)
@given(
    reset=st.sampled_from(["subtract", "none", "zero"]),
    kind=st.sampled_from(["leaky", "lapicque", "synaptic"]),
    learn=st.booleans(),
    double=st.booleans(),
    n=st.sampled_from([6, 100]),
    T=st.integers(1, 12),
    chunk=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_the_compiled_and_numpy_loops_are_bitwise_the_torch_loop(
    reset: str, kind: str, learn: bool, double: bool, n: int, T: int, chunk: int, seed: int
) -> None:
    """CPU steps run the membrane recurrence compiled (Numba, `jit_loops`) or, small ones
    without it, through NumPy (`host_loops`); with each switched off in turn until every step
    runs the torch loop, spikes, membranes and gradients are bitwise the same: every reset
    (Leaky's "zero" resets before the input, Lapicque's and Synaptic's after it), per-neuron
    and learnable decays, float64 included, 300 elements a step (a block of 256 and a part)."""
    from spikeckpt.adapters import host_loops, jit_loops

    dtype = torch.float64 if double else torch.float32
    torch.manual_seed(seed)
    # snnTorch's Lapicque takes a scalar beta only (a tensor fails in its own step), and
    # learning it is refused (its buffer C holds a graph: an snnTorch bug)
    learn = learn and kind != "lapicque"
    beta = torch.rand(n) * 1.1 if learn else 0.9
    neuron: nn.Module
    if kind == "synaptic":
        alpha = torch.rand(n) if learn else 0.8
        neuron = snn.Synaptic(
            alpha=alpha, beta=beta, learn_alpha=learn, learn_beta=learn, reset_mechanism=reset
        )
    else:
        layer = snn.Lapicque if kind == "lapicque" else snn.Leaky
        neuron = layer(beta=beta, learn_beta=learn, reset_mechanism=reset, threshold=0.6)
    net = nn.Sequential(nn.Linear(4, n), neuron).to(dtype)
    x = (torch.rand(T, 3, 4, dtype=dtype) * 2).requires_grad_()
    results = []
    loops = [(True, host_loops.HOST_LOOP_ELEMENTS), (False, 1 << 20), (False, -1)]
    family = "synaptic" if kind == "synaptic" else "leaky"
    calls = {f"{family}_forward_jit": 0, f"{family}_backward_jit": 0}
    compiled = {name: getattr(jit_loops, name) for name in calls}

    def counting(name: str) -> Callable[..., None]:
        def call(*args: Any) -> None:
            calls[name] += 1
            compiled[name](*args)

        return call

    for use_jit, limit in loops:
        previous = host_loops.USE_JIT, host_loops.HOST_LOOP_ELEMENTS
        host_loops.USE_JIT, host_loops.HOST_LOOP_ELEMENTS = use_jit, limit
        for name in calls:
            setattr(jit_loops, name, counting(name))
        try:
            seq = sc.wrap(net, granularity="layer", chunk=min(chunk, T), output="both")
            spikes, mems = seq(x)
            assert seq.last_stats.blocks[0].neuron == "fused"
            grads = torch.autograd.grad(
                (spikes * 0.5 + mems * torch.linspace(-1, 1, n, dtype=dtype)).sum(),
                [x, *(p for p in net.parameters() if p.requires_grad)],
            )
        finally:
            host_loops.USE_JIT, host_loops.HOST_LOOP_ELEMENTS = previous
            for name, function in compiled.items():
                setattr(jit_loops, name, function)
        results.append((spikes.detach(), mems.detach(), grads))
        chunks = -(-T // min(chunk, T))
        if use_jit:  # the compiled loops ran every chunk of the forward and the backward pass
            assert min(calls.values()) >= chunks, calls
            calls = dict.fromkeys(calls, 0)
        else:
            assert calls == dict.fromkeys(calls, 0), calls
    assert host_loops.USE_JIT, "Numba is a dependency: the compiled loop should run here"
    (s_a, m_a, g_a) = results[-1]
    for s_b, m_b, g_b in results[:-1]:
        assert torch.equal(s_a, s_b) and torch.equal(m_a, m_b)
        for a, b in zip(g_a, g_b, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rows", ["one", "all", "over the input"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_loop_writes_what_the_numpy_loop_writes(rows: str, dtype: torch.dtype) -> None:
    """The compiled recurrence on its own, against NumPy's: the last membrane only, every
    membrane, and every membrane over the input's own memory (the room the untaped backward
    hands it); 16 x 37 neurons (two blocks and a part), per-neuron decay, the two resets
    NumPy's loop runs."""
    from spikeckpt.adapters import host_loops

    torch.manual_seed(3)
    k, shape = 9, (16, 37)
    decay = (torch.rand(37) * 1.1).to(dtype)
    thr = torch.tensor(0.6, dtype=dtype)
    mem0 = torch.randn(shape, dtype=dtype)
    zin = torch.randn(k, *shape, dtype=dtype)
    for reset in ("subtract", "none"):
        outputs = []
        for use_jit in (True, False):
            room = torch.empty(k + 1, *shape, dtype=dtype)
            room[1:] = zin
            fires = torch.zeros(k + 1, *shape, dtype=torch.bool)
            fires[0] = mem0 > thr
            mems = {"one": None, "all": torch.full_like(room, 7.0), "over the input": room}[rows]
            z = room[1:] if rows == "over the input" else zin.clone()
            previous = host_loops.USE_JIT
            host_loops.USE_JIT = use_jit
            try:
                if mems is not None:
                    mems[0] = mem0
                last = host_loops.leaky_forward_on_host(mem0, z, decay, thr, reset, mems, fires)
                g = torch.randn(k, *shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
                carry = host_loops.leaky_backward_on_host(g, decay, mem0 * 0.5, reset, fires)
            finally:
                host_loops.USE_JIT = previous
            assert last is not None and carry is not None
            outputs.append((last.clone(), fires, mems, g, carry))
        (l_a, f_a, m_a, g_a, c_a), (l_b, f_b, m_b, g_b, c_b) = outputs
        assert torch.equal(l_a, l_b) and torch.equal(f_a, f_b)
        assert torch.equal(g_a, g_b) and torch.equal(c_a, c_b)
        assert (m_a is None) == (m_b is None)
        if m_a is not None:
            assert torch.equal(m_a[1:], m_b[1:])
        assert f_a[1:].any() and not f_a[1:].all()


def test_a_weight_changed_between_steps_is_read_afresh_even_through_data() -> None:
    """The sparse first synapse keeps a small weight's transpose for one pass only: a weight
    changed between training steps (an optimizer's in-place update, or ``.data`` writes
    that do not bump the version counter) gives the results of the changed weight."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 12), snn.Leaky(beta=0.9))
    x = (torch.rand(9, 3, 20) < 0.05).float()  # sparse enough for the gather
    seq = sc.wrap(net, granularity="layer", chunk=4, readout="sum")
    fresh = sc.wrap(net, granularity="layer", chunk=4, readout="sum")
    for change in (lambda w: w.data.mul_(-1.5), lambda w: w.data.copy_(torch.randn_like(w))):
        seq(sc.SpikeTrain.from_dense(x)).sum().backward()
        with torch.no_grad():
            change(net[0].weight)
        net.zero_grad(set_to_none=True)
        got = seq(sc.SpikeTrain.from_dense(x))
        got.sum().backward()
        got_grad = net[0].weight.grad.clone()
        net.zero_grad(set_to_none=True)
        want = fresh(sc.SpikeTrain.from_dense(x))
        want.sum().backward()
        assert torch.equal(got, want)
        assert torch.equal(got_grad, net[0].weight.grad)
        net.zero_grad(set_to_none=True)


@pytest.mark.parametrize("differs", [False, True])
def test_stats_say_how_a_compiled_neuron_ran(
    differs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compile=True``, layer-wise: a compiled forward that matches the eager one is used and
    ``last_stats`` says "compiled"; one that differs (as Triton's contracted multiply-adds did
    on an H200) is checked on the first chunk of each shape, never used, and the stats say
    "fused" (the eager kernel that ran), with the eager kernel's values. ``torch.compile`` is
    replaced by a wrapper (exact, or one that moves the membrane) to decide the outcome."""
    from spikeckpt.engine import compiled as compiled_module

    def fake_compile(
        fn: Callable[..., Any], dynamic: bool = False, options: Any = None
    ) -> Callable[..., Any]:
        assert options == compiled_module.eager_numerics()

        def run(leaves: list[Tensor], *rest: Any) -> Any:
            final, y, mem, saved = fn(leaves, *rest)
            return [f + 1 if differs else f for f in final], y, mem, saved

        return run

    monkeypatch.setattr(compiled_module.torch, "compile", fake_compile)
    monkeypatch.setattr(compiled_module, "compiler_missing", lambda device_type: None)
    monkeypatch.setattr(compiled_module, "compiled_is_faster", lambda *args: True)
    monkeypatch.setattr(compiled_module, "_WARNED", set())  # its one line, again
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), snn.Leaky(beta=0.9))
    x = (torch.rand(11, 3, 4) < 0.5).float()
    eager = sc.wrap(net, granularity="layer", chunk=4, compile=False)
    want, want_state = eager(x, return_state=True)
    seq = sc.wrap(net, granularity="layer", chunk=4, compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_state = seq(x, return_state=True)
    chunks = seq.last_stats.blocks[0].neuron_chunks
    assert chunks == ({"fused": 3} if differs else {"compiled": 3}), chunks
    assert torch.equal(got, want)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(got_state),
        torch.utils._pytree.tree_leaves(want_state),
        strict=True,
    ):
        assert torch.equal(a, b)
    assert any("differed from the eager one" in str(w.message) for w in caught) == differs


def test_a_compiled_neuron_runs_eagerly_under_a_dispatch_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``compile=True``, layer-wise, under ``MemoryMeter(mode="tensors")`` (a dispatch mode):
    the compiled forward is never called (dynamo would skip the frame, and torch up to 2.13
    then ran it eagerly for good), the stats say "fused"; after the meter, "compiled" again.
    ``torch.compile`` is replaced by a counting wrapper."""
    from spikeckpt.engine import compiled as compiled_module
    from spikeckpt.engine.meter import MemoryMeter

    calls: list[int] = []

    def counting_compile(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            calls.append(1)
            return fn(*args)

        return run

    monkeypatch.setattr(compiled_module.torch, "compile", counting_compile)
    monkeypatch.setattr(compiled_module, "compiler_missing", lambda device_type: None)
    monkeypatch.setattr(compiled_module, "compiled_is_faster", lambda *args: True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), snn.Leaky(beta=0.9))
    x = (torch.rand(11, 3, 4) < 0.5).float()
    seq = sc.wrap(net, granularity="layer", chunk=4, compile=True)
    want = seq(x)
    assert seq.last_stats.blocks[0].neuron_chunks == {"compiled": 3}
    before = len(calls)
    with MemoryMeter(mode="tensors"):
        measured = seq(x)
    assert len(calls) == before, "the compiled forward was called under a dispatch mode"
    assert seq.last_stats.blocks[0].neuron_chunks == {"fused": 3}
    assert torch.equal(measured, want)
    seq(x)
    assert seq.last_stats.blocks[0].neuron_chunks == {"compiled": 3} and len(calls) > before


def test_a_compiled_neuron_does_not_outlive_its_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile=True``, layer-wise: the compiled kernels live with the wrapped model; once
    model and wrapper are gone, nothing of spikeckpt keeps the model's neurons (and their
    parameters, on a GPU its memory) alive: a sweep that wraps many models does not grow.
    (A module-level table kept every compiled kernel, and through it the Norse cells; snnTorch
    keeps its own neurons alive in ``SpikingNeuron.instances``, hence Norse here.)
    ``torch.compile`` is replaced by a pass-through wrapper."""
    import gc
    import weakref

    norse = pytest.importorskip("norse.torch")
    from spikeckpt.engine import compiled as compiled_module

    monkeypatch.setattr(
        compiled_module.torch, "compile", lambda fn, **kwargs: lambda *args: fn(*args)
    )
    monkeypatch.setattr(compiled_module, "compiler_missing", lambda device_type: None)
    monkeypatch.setattr(compiled_module, "compiled_is_faster", lambda *args: True)
    x = (torch.rand(9, 3, 4) < 0.5).float()
    cells: list[weakref.ref[nn.Module]] = []
    for _ in range(3):
        net = norse.SequentialState(
            nn.Linear(4, 6), norse.LIFCell(), nn.Linear(6, 2), norse.LICell()
        )
        seq = sc.wrap(net, granularity="layer", chunk=4, compile=True)
        seq(x)[0].sum().backward()
        assert seq.last_stats.blocks[0].neuron_chunks == {"compiled": 3}
        cells += [weakref.ref(net[1]), weakref.ref(net[3])]
        del net, seq
    gc.collect()
    assert [ref() is None for ref in cells] == [True] * 6


class _ProductRows(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the rows of every matrix product's left operand (``mm``, ``addmm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.rows.add(args[-2].shape[0])
        return func(*args, **(kwargs or {}))


def _exact_nets() -> dict[str, Callable[[], nn.Sequential]]:
    return {
        "linear": lambda: nn.Sequential(
            nn.Linear(512, 64), snn.Leaky(beta=0.95, threshold=0.5),
            nn.Linear(64, 32), snn.Leaky(beta=0.9, threshold=0.3),
        ),
        "conv": lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), snn.Leaky(beta=0.9, threshold=0.4),
            nn.Flatten(), nn.Linear(4 * 8 * 8, 16), snn.Leaky(beta=0.9, threshold=0.3),
        ),
        # one block draws: its masks come in the loop's order (with draws in two blocks,
        # layer-wise draws one block's masks for a chunk before the next block's)
        "dropout": lambda: nn.Sequential(
            nn.Linear(512, 64), nn.Dropout(0.3), snn.Leaky(beta=0.95, threshold=0.5),
            nn.Linear(64, 32), snn.Leaky(beta=0.9, threshold=0.3),
        ),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["linear", "conv", "dropout"])
def test_exact_is_bitwise_the_plain_loop(name: str) -> None:
    """``exact=True``: every synapse runs step by step, as the plain loop runs it, so the top
    spikes and membranes are bitwise the loop's (the default's products over a chunk, and its
    gather, may round otherwise: cuBLAS and some CPUs do) and the gradients at round-off;
    the neuron is still fused, and no matrix product spans more than one step's rows."""
    torch.manual_seed(0)
    net = _exact_nets()[name]()
    T, B = 30, 4
    shape = (2, 8, 8) if name == "conv" else (512,)
    x = (torch.rand(T, B, *shape) < 0.05).float()
    torch.manual_seed(1)
    spikes, mems = _plain_loop(net, x)
    want = torch.autograd.grad(mems.square().sum(), list(net.parameters()))
    seq = sc.wrap(net, granularity="layer", chunk=8, output="both", exact=True)
    recorder = _ProductRows()
    torch.manual_seed(1)
    with recorder:
        s, m = seq(x)
    assert seq.exact is True and seq.last_stats.blocks[0].neuron == "fused"
    assert torch.equal(s, spikes) and torch.equal(m, mems)
    got = torch.autograd.grad(m.square().sum(), list(net.parameters()))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert recorder.rows == {B}, recorder.rows  # the forward's products: one step each
    default = _ProductRows()
    with default:
        sc.wrap(net, granularity="layer", chunk=8, output="both")(x)
    assert max(default.rows) > B  # the default's products span the chunk (the check can fail)


def test_is_unit_reads_a_factor_once_per_version() -> None:
    """The graded-spike factor's value is read (``aten::_local_scalar_dense``: a device sync on
    CUDA) once per tensor and version, not at every chunk: the cache was a
    ``WeakKeyDictionary``, whose lookup compared tensors with ``==`` and so read the value
    each time (40 reads per step of the peers' benchmark)."""
    from spikeckpt.adapters.kernels import is_unit

    class Reads(torch.utils._python_dispatch.TorchDispatchMode):
        count = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func is torch.ops.aten._local_scalar_dense.default:
                Reads.count += 1
            return func(*args, **(kwargs or {}))

    one, two = torch.tensor(1.0), torch.tensor(2.0)
    with Reads():
        assert is_unit(one) and not is_unit(two)
        first = Reads.count
        for _ in range(5):
            assert is_unit(one) and not is_unit(two)
        assert Reads.count == first == 2
        one.fill_(3.0)  # a new version: read again
        assert not is_unit(one) and Reads.count == 3
    assert not is_unit(torch.tensor(1.0, requires_grad=True))


def _odd_nets() -> dict[str, Callable[[], nn.Sequential]]:
    """Widths and a batch (3) such that one step's row is not a multiple of 16 bytes: a step of
    a chunk buffer then starts at another address modulo 16 than a new tensor does.
    ``"view"``: the second block's ``Linear(5, 4)`` reads the first block's spikes; ``"chain"``:
    the ``Linear`` reads the ``Dropout`` before it."""
    return {
        "view": lambda: nn.Sequential(
            nn.Linear(6, 5), snn.Leaky(beta=0.9, threshold=0.5, init_hidden=True, learn_beta=True),
            nn.Linear(5, 4), snn.Synaptic(alpha=0.8, beta=0.9, init_hidden=True, output=True),
        ),
        "chain": lambda: nn.Sequential(
            nn.Dropout(0.3), nn.Linear(5, 4),
            snn.Synaptic(alpha=0.8, beta=0.9, init_hidden=True, output=True),
        ),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["view", "chain"])
def test_exact_is_bitwise_the_plain_loop_whatever_the_steps_addresses(name: str) -> None:
    """``exact=True`` on widths and a batch whose step rows are not multiples of 16 bytes:
    MKL's small products round differently with the input's address modulo 16 bytes, and the
    per-step synapse read each step as a view of the chunk buffer (and each layer's output as
    a view of the stacked chunk), where the loop hands the next layer a new tensor: membranes
    were 2.4e-7 off (found by fuzzing). Each step now runs the block's layers in turn on new
    tensors, as the loop does."""
    from snntorch import utils

    for seed in range(6):  # one step in a few rounds otherwise (seeds 4 and 5 did on "view")
        torch.manual_seed(seed)
        net = _odd_nets()[name]()
        with torch.no_grad():
            for layer in net:
                if isinstance(layer, nn.Linear):
                    layer.weight.mul_(3)
        x = (torch.rand(30, 3, 6 if name == "view" else 5) < 0.4).float()
        utils.reset(net)
        torch.manual_seed(1)
        outs = [net(x_t) for x_t in x]
        want = [torch.stack([o[i] for o in outs]) for i in range(3)]  # spk, syn, mem
        grads = torch.autograd.grad(want[2].square().sum(), list(net.parameters()))
        seq = sc.wrap(net, granularity="layer", chunk=4, exact=True)
        torch.manual_seed(1)
        got = seq(x)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (seed, (a - b).abs().max())
        loss = got[2].square().sum()
        for a, b in zip(torch.autograd.grad(loss, list(net.parameters())), grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_leaky_without_reset_delay_gives_float32_spikes_in_a_float64_model() -> None:
    """snnTorch's spike is ``(u > 0).float()`` whatever the membrane's dtype, times the
    graded factor: a float64 ``Leaky(reset_delay=False)`` with a 0-d factor returns float32
    spikes. The fused kernel returned them in the membrane's dtype (float64), and the check
    against the step compared values only."""
    from snntorch import utils

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(6, 5), snn.Leaky(beta=0.9, init_hidden=True, reset_delay=False, output=True)
    ).double()
    x = torch.rand(7, 3, 6, dtype=torch.float64) * 2
    utils.reset(net)
    outs = [net(x_t) for x_t in x]
    spikes, mems = torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
    assert spikes.dtype == torch.float32
    # exact: the Linear step by step, as the loop runs it (a float64 product over the chunk
    # rounds otherwise on some BLAS kernels: 2.2e-16 apart on an AVX-512 Xeon)
    seq = sc.wrap(net, granularity="layer", chunk=3, output="both", exact=True)
    s, m = seq(x)
    assert seq.last_stats.blocks[0].neuron == "fused"
    assert s.dtype == spikes.dtype and torch.equal(s, spikes)
    assert m.dtype == mems.dtype and torch.equal(m, mems)


def test_exact_untaped_recomputation_reads_the_steps_as_the_forward_pass() -> None:
    """With ``exact=True`` a block after the first recomputes its ``Linear`` untaped
    (`LinearChunk`, step by step); it must compute what the block's synapse computed in the
    forward pass, bitwise, where the steps are views at unaligned addresses of the chunk."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), snn.Leaky(beta=0.9), nn.Linear(5, 4), snn.Leaky(beta=0.9))
    seq = sc.wrap(net, granularity="layer", chunk=4, exact=True)
    block = seq.layer_blocks(True)[1]
    assert block.affine is not None
    for seed in range(4):
        torch.manual_seed(seed)
        x = (torch.rand(8, 3, 5) < 0.5).float() * (torch.rand(5) + 0.5)  # graded spikes
        with torch.no_grad():
            made = block.affine.forward(x, False)
            assert made is not None
            assert torch.equal(made[0], block.synapse(x))


def _tutorial_net(top: nn.Module) -> nn.Sequential:
    """snnTorch tutorial 5-7's shape: hidden neurons with ``init_hidden=True`` and a top
    neuron with ``output=True``, so ``spk, mem = net(x_t)`` at each step."""
    return nn.Sequential(
        nn.Linear(12, 9), snn.Leaky(beta=0.9, threshold=0.4, init_hidden=True),
        nn.Linear(9, 5), top,
    )  # fmt: skip


_TOPS: dict[str, Callable[[], nn.Module]] = {
    "leaky": lambda: snn.Leaky(beta=0.85, threshold=0.3, init_hidden=True, output=True),
    "leaky zero learnable": lambda: snn.Leaky(
        beta=0.8, reset_mechanism="zero", learn_beta=True, init_hidden=True, output=True
    ),
    "leaky reset_delay False": lambda: snn.Leaky(
        beta=0.85, threshold=0.3, reset_delay=False, init_hidden=True, output=True
    ),
    "lapicque": lambda: snn.Lapicque(beta=0.85, threshold=0.3, init_hidden=True, output=True),
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    top=st.sampled_from(sorted(_TOPS)),
    T=st.integers(1, 17),
    chunk=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_a_top_neuron_returning_its_membrane_stays_fused(
    top: str, T: int, chunk: int, seed: int
) -> None:
    """The tutorials' net ends with ``Leaky(init_hidden=True, output=True)``: wrapped, it
    returns ``spk, mem`` as the call does. The call returns the membrane only, which the
    fused kernel emits, so the top block is fused (it ran per step, 1.44x the time of the
    same net with ``output="both"``: 784-512-10, T = 500, batch 16), and the outputs are
    bitwise the loop's (``exact=True``), gradients at round-off."""
    from snntorch import utils

    torch.manual_seed(seed)
    net = _tutorial_net(_TOPS[top]())
    with torch.no_grad():
        net[0].weight.mul_(3)
    x = (torch.rand(T, 2, 12) < 0.4).float()
    utils.reset(net)
    outs = [net(x_t) for x_t in x]
    spikes, mems = torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
    params = list(net.parameters())
    want = _grads(mems, params)
    seq = sc.wrap(net, granularity="layer", chunk=chunk, exact=True)
    s, m = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    assert torch.equal(s, spikes) and torch.equal(m, mems)
    for a, b in zip(_grads(m, params), want, strict=True):
        _close(b, a, top)


def test_a_top_neuron_returning_more_than_its_membrane_stays_fused() -> None:
    """``Synaptic(output=True)`` returns ``spk, syn, mem``: the kernel emits ``syn`` and
    ``mem`` per step, so that block stays fused (and returns what the call returns; checked
    against the loop in ``test_call_outputs_fused.py``)."""
    torch.manual_seed(0)
    net = _tutorial_net(snn.Synaptic(alpha=0.8, beta=0.85, init_hidden=True, output=True))
    x = (torch.rand(6, 2, 12) < 0.4).float()
    spk, syn, mem = sc.wrap(net, granularity="layer", chunk=4)(x)
    assert spk.shape == syn.shape == mem.shape == (6, 2, 5)
    seq = sc.wrap(net, granularity="layer", chunk=4)
    seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5), (25, 16, 512), (7, 300, 2)])
def test_spikes_cast_through_bytes_are_torchs_cast(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """`as_spikes` (a boolean tensor cast through a ``uint8`` view where it is large): the
    values, dtype and shape of ``.to(dtype)``, a strided view included."""
    from spikeckpt.adapters.kernels import CAST_VIA_BYTES, as_spikes

    fired = torch.rand(shape) < 0.3
    for t in (fired, fired.transpose(0, -1), fired[::2]):
        got, want = as_spikes(t, dtype), t.to(dtype)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert (fired.numel() >= CAST_VIA_BYTES) == (shape != (3, 5))  # both paths tested
    floats = torch.rand(shape)  # not boolean: cast as given
    assert torch.equal(as_spikes(floats, dtype), floats.to(dtype))
