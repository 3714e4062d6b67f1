"""Model zoo, the patterns themselves: weight sharing, BatchNorm in training mode, layers and
neurons of your own, and ``scan`` with the states and steps people write (parameters found on
the step's ``self``/closure, ``init_leaky()``/``None``/0-d initial states), each compared with
its own plain loop.
"""

from __future__ import annotations

import copy
import functools
import types
import warnings
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from zoo_common import PLAN_IDS, PLANS, check, compare, run

import spikeckpt as sc
from spikeckpt.adapters import CustomLayerAdapter, StatefulAdapter, adapter_for
from spikeckpt.adapters.sequential import split_blocks
from spikeckpt.models import spike
from spikeckpt.plans import Uniform

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    snn = pytest.importorskip("snntorch")
    from snntorch import utils as snn_utils  # noqa: E402

T, B = 7, 3


def seq_loop(model: nn.Module, x: Tensor) -> Tensor:
    """The plain loop of an ``nn.Sequential`` of ``init_hidden`` neurons."""
    snn_utils.reset(model)
    outs = [model(x[t]) for t in range(x.shape[0])]
    return torch.utils._pytree.tree_map(lambda *ys: torch.stack(ys), *outs)


# ----------------------------------------------------------------------------- weight sharing


def shared_linear() -> nn.Sequential:
    lin = nn.Linear(5, 5)
    return nn.Sequential(lin, nn.ReLU(), lin, snn.Leaky(beta=0.8, init_hidden=True))


def shared_neuron() -> nn.Sequential:
    lif = snn.Leaky(beta=0.8, init_hidden=True, learn_beta=True, threshold=0.3)
    return nn.Sequential(nn.Linear(5, 5), lif, nn.Linear(5, 5), lif)


def shared_across_blocks() -> nn.Sequential:
    lin = nn.Linear(5, 5)
    return nn.Sequential(
        lin,
        snn.Leaky(beta=0.8, init_hidden=True),
        lin,
        nn.Dropout(0.2),
        snn.Leaky(beta=0.7, init_hidden=True),
    )


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
@pytest.mark.parametrize("build", [shared_linear, shared_neuron, shared_across_blocks])
def test_weight_sharing_runs_every_position(build: Any, plan: Any) -> None:
    """A module at several positions runs at each; a neuron whose state lives on the module
    threads that one state through its positions, as the plain loop does."""
    x = torch.rand(T, B, 5) * 2
    route = lambda m, x: sc.wrap(m, plan=plan)(x)  # noqa: E731
    check(build, seq_loop, route, x, "weight sharing (" + build.__name__ + ")")


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_weight_sharing_layerwise(plan: Any) -> None:
    x = (torch.rand(T, B, 5) < 0.5).float()
    route = lambda m, x: sc.wrap(m, plan=plan, granularity="layer")(x)  # noqa: E731
    check(shared_across_blocks, seq_loop, route, x, "weight sharing, layer-wise")


def test_weight_sharing_that_no_layout_reproduces_is_refused() -> None:
    lif = snn.Leaky(beta=0.8, init_hidden=True)
    nested = nn.Sequential(nn.Linear(4, 4), lif, nn.Sequential(nn.Linear(4, 4), lif))
    with pytest.raises(sc.UnsupportedLayerError, match=r"(?s)'2\.1'.*also used at '1'"):
        sc.wrap(nested)
    with pytest.raises(sc.UnsupportedLayerError, match=r"(?s)'3'.*threaded through"):
        sc.wrap(shared_neuron(), granularity="layer")


# ----------------------------------------------------------------------------- BatchNorm


def bn_net(kind: str, momentum: float | None) -> nn.Sequential:
    """A snnTorch stack with BatchNorm in training mode (running statistics tracked)."""
    leaky = lambda: snn.Leaky(beta=0.7, init_hidden=True, threshold=0.5)  # noqa: E731
    if kind == "1d":
        return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6, momentum=momentum), leaky())
    if kind == "1d-seq":  # (B, C, L)
        return nn.Sequential(nn.Conv1d(2, 3, 3), nn.BatchNorm1d(3, momentum=momentum), leaky())
    if kind == "2d":
        return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, momentum=momentum), leaky())
    if kind == "3d":
        return nn.Sequential(nn.Conv3d(2, 3, 2), nn.BatchNorm3d(3, momentum=momentum), leaky())
    return nn.Sequential(  # instance
        nn.Conv2d(2, 3, 3), nn.InstanceNorm2d(3, track_running_stats=True), leaky()
    )


_BN_INPUT = {"1d": (5,), "1d-seq": (2, 6), "2d": (2, 5, 5), "3d": (2, 3, 3, 3), "in": (2, 5, 5)}


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
@pytest.mark.parametrize(
    ("kind", "momentum"),
    [("1d", 0.1), ("1d", None), ("1d-seq", 0.1), ("2d", 0.3), ("3d", None), ("in", 0.1)],
)
def test_batchnorm_training_mode(
    kind: str, momentum: float | None, plan: Any, granularity: str
) -> None:
    """Batch statistics per step; running statistics and ``num_batches_tracked`` equal to the
    plain loop's (updated once per step, never in recomputation nor in shape probes)."""
    x = torch.rand(T, B, *_BN_INPUT[kind]) * 2
    # exact: layer-wise, each step's products as the loop's (outputs bitwise on any BLAS)
    exact = granularity == "layer"
    route = lambda m, x: sc.wrap(m, plan=plan, granularity=granularity, exact=exact)(x)  # noqa: E731
    layer = "InstanceNorm2d" if kind == "in" else f"BatchNorm {kind}"
    name = f"{layer} training mode, {granularity}"
    check(lambda: bn_net(kind, momentum), seq_loop, route, x, name)


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_batchnorm_counts_one_update_per_step_and_evaluates_like_the_loop(plan: Any) -> None:
    torch.manual_seed(0)
    model = bn_net("2d", 0.1)
    x = torch.rand(T, B, 2, 5, 5) * 2
    y = sc.wrap(model, plan=plan)(x)
    y.sum().backward()
    assert int(model[1].num_batches_tracked) == T
    model.eval()
    torch.testing.assert_close(sc.wrap(model, plan=plan)(x), seq_loop(model, x), rtol=0, atol=0)


# ----------------------------------------------------------------------------- your own layers


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = nn.Parameter(torch.tensor(factor))

    def forward(self, x: Tensor) -> Tensor:
        return self.factor * x


class Residual(nn.Module):
    """A stateless block of ours looping over its own layers (not over time)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(5, 5), nn.Tanh()])

    def forward(self, x: Tensor) -> Tensor:
        y = x
        for layer in self.layers:
            y = layer(y)
        return x + y


class Counter(nn.Module):
    """Keeps state on itself: refused."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        self.seen += 1
        return x


class Synaptic2(nn.Module):
    """A hand-written two-state neuron: ``forward(x, syn, mem) -> (spk, syn, mem)``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.full((n,), 0.6))
        self.beta = nn.Parameter(torch.full((n,), 0.8))

    def forward(self, x: Tensor, syn: Tensor, mem: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        syn = self.alpha * syn + x
        mem = self.beta * mem + syn
        spk = spike(mem - 1.0)
        return spk, syn, mem - spk.detach()


class RenamedState(nn.Module):
    """Tutorial 5's neuron with its argument renamed ``state``, required (fails on None)."""

    def __init__(self) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.tensor(0.9))

    def forward(self, input_: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        spk = spike(state - 1.0)
        return spk, self.beta * state + input_ - spk.detach()


def custom_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 5), Scale(3.0), Residual(), Synaptic2(5), nn.Linear(5, 5), RenamedState()
    )


def custom_loop(model: nn.Sequential, x: Tensor) -> Tensor:
    fc1, scale, res, neuron, fc2, renamed = model
    syn = mem = state = torch.zeros(x.shape[1], 5)
    out = []
    for t in range(x.shape[0]):
        spk, syn, mem = neuron(res(scale(fc1(x[t]))), syn, mem)
        y, state = renamed(fc2(spk), state)
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_custom_layers_and_neurons_without_registration(plan: Any, granularity: str) -> None:
    x = torch.rand(T, B, 4)
    route = lambda m, x: sc.wrap(m, plan=plan, granularity=granularity)(x)  # noqa: E731
    check(custom_net, custom_loop, route, x, "custom layers and neurons")


def test_custom_layer_classification() -> None:
    assert isinstance(adapter_for(Scale(2.0)), CustomLayerAdapter)
    assert isinstance(adapter_for(Residual()), CustomLayerAdapter)
    neuron = adapter_for(Synaptic2(3))
    assert isinstance(neuron, StatefulAdapter) and neuron.n_state == 2
    state = neuron.init_state(torch.rand(2, 3))
    assert [tuple(s.shape) for s in state] == [(2, 3), (2, 3)] and not any(s.any() for s in state)
    renamed = adapter_for(RenamedState())
    assert isinstance(renamed, StatefulAdapter) and not renamed.starts_from_none


def test_state_kept_on_the_module_is_named() -> None:
    seq = sc.wrap(nn.Sequential(nn.Linear(4, 4), Counter(), nn.GRUCell(4, 3)))
    with pytest.raises(sc.UnsupportedLayerError, match=r"(?s)layer '1'.*self\.buffer seen"):
        seq(torch.rand(T, B, 4))


class TimeLoop(nn.Module):
    """A hand-written recurrence in forward, no neuron module inside."""

    def __init__(self) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.tensor(0.9))

    def forward(self, x: Tensor) -> Tensor:
        v = torch.zeros_like(x[0])
        out = []
        for t in range(x.shape[0]):
            v = self.beta * v + x[t]
            out.append(v)
        return torch.stack(out)


def test_a_module_with_its_own_time_loop_is_refused_with_the_route() -> None:
    with pytest.raises(sc.UnsupportedLayerError) as info:
        sc.wrap(nn.Sequential(nn.Linear(3, 3), TimeLoop()))
    msg = str(info.value)
    assert "layer '1'" in msg and "loops over range" in msg and "spikeckpt.scan" in msg
    assert "Supported layers" in msg


def test_layerwise_refuses_synapses_that_draw_random_numbers() -> None:
    class Noisy(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x + 0.1 * torch.randn_like(x)

    model = nn.Sequential(nn.Linear(3, 3), Noisy(), snn.Leaky(beta=0.5, init_hidden=True))
    with pytest.raises(sc.UnsupportedLayerError, match=r"(?s)'1'.*random numbers"):
        split_blocks(adapter_for(model))
    x = torch.rand(T, B, 3)
    check(lambda: model, seq_loop, lambda m, x: sc.wrap(m, plan=Uniform(3))(x), x)


class StochasticNeuron(nn.Module):
    """Spikes drawn with probability ``sigmoid(v - 1)`` from a ``torch.Generator`` of its own
    (a straight-through estimator for the gradient)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.gen = torch.Generator().manual_seed(1)

    def initial_state(self, x: Tensor) -> Tensor:
        return x.new_zeros(x.shape[0], self.n)

    def draw(self, p: Tensor) -> Tensor:
        """Uniform numbers shaped like ``p`` (a helper: ``forward`` names no random function,
        so only the run-time check sees the draw)."""
        return torch.rand(p.shape, generator=self.gen)

    def forward(self, x: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        v = 0.9 * v + x
        p = torch.sigmoid(v - 1)
        s = (self.draw(p) < p).float() + p - p.detach()
        return s, v - s.detach()


def test_layerwise_refuses_a_neuron_drawing_from_its_own_generator() -> None:
    """Layer-wise recomputes every chunk in the backward pass and replays the default
    generators only: a neuron drawing from a ``torch.Generator`` of its own drew other
    numbers there (weight gradient 0.61 off the loop's, outputs equal: silently). Refused after
    the forward, naming the way; under no_grad (nothing recomputed) it runs."""
    model = nn.Sequential(nn.Linear(4, 6), StochasticNeuron(6))
    x = torch.rand(T, B, 4)
    with pytest.raises(sc.ConfigError, match=r"torch\.Generator of its own.*granularity='stack'"):
        sc.wrap(model, granularity="layer", chunk=3)(x)
    with torch.no_grad():
        assert sc.wrap(model, granularity="layer", chunk=3)(x).shape == (T, B, 6)


class ConvBlock(nn.Module):
    """A one-step block of ours: conv, BatchNorm, an ``init_hidden`` neuron (no loop)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout)
        self.lif = snn.Leaky(beta=0.6, init_hidden=True, threshold=0.5, learn_beta=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.lif(self.bn(self.conv(x)))


class Readout(nn.Module):
    """A one-step block of ours whose neuron returns ``(spk, mem)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 4 * 4, 4)
        self.lif = snn.Synaptic(alpha=0.5, beta=0.7, init_hidden=True, output=True)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        spk, syn, mem = self.lif(self.fc(x.flatten(1)))
        return spk, mem


def block_net(readout: bool = True) -> nn.Sequential:
    head = [Readout()] if readout else []
    return nn.Sequential(ConvBlock(2, 3), nn.MaxPool2d(2), ConvBlock(3, 3), *head)


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_blocks_of_yours_with_init_hidden_neurons(plan: Any, granularity: str) -> None:
    """One call is one step: the neurons' states are set, read and cleared around each call."""
    x = torch.rand(T, B, 2, 8, 8) * 2
    route = lambda m, x: sc.wrap(m, plan=plan, granularity=granularity)(x)  # noqa: E731
    build = lambda: block_net(readout=granularity == "stack")  # noqa: E731
    check(build, seq_loop, route, x, "blocks of yours with init_hidden neurons")


class SkipSequential(nn.Sequential):
    """An ``nn.Sequential`` subclass with a forward of its own: not a plain stack."""

    def forward(self, x: Tensor) -> Tensor:
        return x + super().forward(x)


def test_sequential_subclass_with_its_own_forward_is_a_layer_of_yours() -> None:
    build = lambda: nn.Sequential(  # noqa: E731
        SkipSequential(nn.Linear(4, 4), nn.Tanh()), snn.Leaky(beta=0.7, init_hidden=True)
    )
    assert isinstance(adapter_for(SkipSequential(nn.Linear(4, 4))), CustomLayerAdapter)
    x = torch.rand(T, B, 4) * 2
    check(build, seq_loop, lambda m, x: sc.wrap(m, plan=Uniform(3))(x), x, "Sequential subclass")


def _double(module: nn.Module, args: Any, out: Tensor) -> Tensor:
    return out * 2


def _hooked_net(where: str) -> nn.Module:
    """Linear + Leaky + (Linear + Leaky), a forward hook or pre-hook on the root or the
    nested ``nn.Sequential``; weights large enough that both layers spike."""
    inner = nn.Sequential(nn.Linear(6, 3), snn.Leaky(beta=0.8, init_hidden=True))
    net = nn.Sequential(nn.Linear(4, 6), snn.Leaky(beta=0.8, init_hidden=True), inner)
    with torch.no_grad():
        for linear in (net[0], inner[0]):
            linear.weight.mul_(3)
    target = net if where.startswith("root") else inner
    if where.endswith("pre"):
        target.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    else:
        target.register_forward_hook(_double)
    return net


@pytest.mark.parametrize("where", ["root", "root pre", "nested", "nested pre"])
@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_hooks_on_a_sequential_run_at_every_step(where: str, granularity: str) -> None:
    """A forward hook or pre-hook on an ``nn.Sequential`` runs when the plain loop calls it;
    spikeckpt steps a plain ``nn.Sequential``'s layers without calling it, so one with hooks is
    a module of yours, stepped through its call (before: the hooks never ran, outputs 2x off)."""
    x = (torch.rand(T, B, 4) < 0.5).float()
    route = lambda m, x: sc.wrap(m, plan=Uniform(3), granularity=granularity)(x)  # noqa: E731
    hooked = _hooked_net(where)
    plain = copy.deepcopy(hooked)
    for module in plain.modules():
        module._forward_hooks.clear()
        module._forward_pre_hooks.clear()
    with torch.no_grad():  # the hooks matter
        assert not torch.equal(seq_loop(hooked, x), seq_loop(plain, x))
    check(lambda: _hooked_net(where), seq_loop, route, x, f"hook on the {where} Sequential")


# ----------------------------------------------------------------------------- scan's route


class Leak(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n, n)
        self.beta = nn.Parameter(torch.full((n,), 0.8))

    def body(self, v: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor]:
        v = self.beta * v + self.fc(x_t)
        s = spike(v - 1.0)
        return v - s.detach(), s


def _loop_of(step: Any, state: Any) -> Any:
    def loop(m: nn.Module, x: Tensor) -> Tensor:
        s, out = state, []
        for t in range(x.shape[0]):
            s, y = step(m)(s, x[t])
            out.append(y)
        return torch.stack(out)

    return loop


STEPS = {  # how the step reaches the parameters
    "bound method": lambda m: m.body,
    "closure": lambda m: lambda v, x_t: m.body(v, x_t),
    "partial": lambda m: functools.partial(Leak.body, m),
}


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
@pytest.mark.parametrize("how", list(STEPS))
def test_scan_finds_parameters_reachable_from_the_step(how: str, plan: Any) -> None:
    x = torch.rand(T, B, 4) * 2
    v0 = torch.zeros(B, 4)
    make = STEPS[how]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(
            lambda: Leak(4),
            _loop_of(make, v0),
            lambda m, x: sc.scan(make(m), x, v0, plan=plan)[0],
            x,
            f"scan params via {how}",
        )


_GLOBAL_LEAK = Leak(4)


def _global_step(v: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor]:
    return _GLOBAL_LEAK.body(v, x_t)


def test_scan_finds_parameters_of_globals_and_norse_p() -> None:
    x = torch.rand(T, B, 4) * 2
    ys, _ = sc.scan(_global_step, x, torch.zeros(B, 4), plan=Uniform(3))
    ys.sum().backward()
    assert _GLOBAL_LEAK.beta.grad is not None and _GLOBAL_LEAK.fc.weight.grad is not None

    class P(NamedTuple):
        tau: Tensor

    cell = nn.Module()
    cell.p = P(nn.Parameter(torch.full((4,), 0.5)))  # a plain NamedTuple attribute, as Norse's

    def step(v: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor]:
        v = cell.p.tau * v + x_t
        return v, v

    ys, _ = sc.scan(step, x, torch.zeros(B, 4), plan=Uniform(3))
    ys.sum().backward()
    assert cell.p.tau.grad is not None


def test_scan_refuses_when_the_no_grad_path_misses_a_parameter() -> None:
    hidden = types.SimpleNamespace(w=nn.Parameter(torch.ones(4)))

    def step(v: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor]:
        return v, x_t * hidden.w

    with pytest.raises(sc.UnlistedParamsError, match="backward\\(\\) would fail"):
        sc.scan(step, torch.rand(T, B, 4), torch.zeros(B), plan=Uniform(3))
    ys, _ = sc.scan(step, torch.rand(T, B, 4), torch.zeros(B), plan=Uniform(3), params=[hidden.w])
    assert ys.requires_grad
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no_grad on purpose: no warning
        sc.scan(step, torch.rand(T, B, 4), torch.zeros(B), plan=Uniform(3))


def _tree_equal(a: Any, b: Any) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(u, v) for u, v in zip(la, lb, strict=True))


INITIAL = {  # initial states that the first step shapes
    "empty (init_leaky)": lambda: torch.zeros(0),
    "None": lambda: None,
    "0-d": lambda: torch.tensor(0.25),
}


def _shaping_step(m: Leak) -> Any:
    def step(v: Tensor | None, x_t: Tensor) -> tuple[Tensor, Tensor]:
        if v is None or v.numel() == 0:
            v = torch.zeros_like(x_t)
        return m.body(v, x_t)

    return step


def _fold(acc: Tensor | None, y: Tensor, t: int) -> Tensor:
    return y * (t + 1) if acc is None else acc + y * (t + 1)


def _reduce(ys: Tensor, readout: Any) -> Tensor:
    if readout is None:
        return ys
    if readout == "last":
        return ys[-1]
    acc = None
    for t in range(ys.shape[0]):
        acc = (_fold if callable(readout) else lambda a, y, t: y if a is None else a + y)(
            acc, ys[t], t
        )
    assert acc is not None
    return acc / ys.shape[0] if readout == "mean" else acc


@settings(max_examples=25, deadline=None)
@given(
    steps=st.integers(1, 9),
    plan=st.sampled_from(PLANS),
    initial=st.sampled_from(list(INITIAL)),
    readout=st.sampled_from([None, "sum", "mean", "last", "fold"]),
)
def test_scan_takes_the_initial_states_people_write(
    steps: int, plan: Any, initial: str, readout: str | None
) -> None:
    """``init_leaky()`` (empty), ``None`` and 0-d initial states, any T, every readout:
    outputs bitwise, gradients (initial state included) as the loop's."""
    ro: Any = _fold if readout == "fold" else readout
    x = torch.rand(steps, B, 4) * 2
    state = INITIAL[initial]()

    def loop(m: Leak, x: Tensor) -> Any:
        return _reduce(_loop_of(_shaping_step, state)(m, x), ro)

    def route(m: Leak, x: Tensor) -> Any:
        ys, final = sc.scan(_shaping_step(m), x, state, plan=plan, readout=ro)
        assert final.shape == (B, 4)
        return ys

    check(lambda: Leak(4), loop, route, x, "scan initial states")


def test_norse_initial_state_with_a_0d_membrane() -> None:
    nt = pytest.importorskip("norse.torch")
    torch.manual_seed(0)
    fc, cell = nn.Linear(4, 5), nt.LIFCell(nt.LIFParameters(v_th=torch.as_tensor(0.1)))
    x = torch.rand(T, B, 4) * 5
    s0 = cell.initial_state(fc(x[0]))
    assert s0.v.dim() == 0

    def step(s: Any, x_t: Tensor) -> Any:
        z, s = cell(fc(x_t), s)
        return s, z

    def loop(_: nn.Module, x: Tensor) -> Tensor:
        s, out = s0, []
        for t in range(T):
            s, z = step(s, x[t])
            out.append(z)
        return torch.stack(out)

    model = nn.ModuleList([fc, cell])
    ref = run(loop, model, x)
    for plan in PLANS:
        got = run(lambda m, x, plan=plan: sc.scan(step, x, s0, plan=plan)[0], model, x)
        compare(ref, got, "Norse initial_state (0-d v)")
