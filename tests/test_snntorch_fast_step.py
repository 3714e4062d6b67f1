"""The stack granularity's fast snnTorch steps (``spikeckpt.adapters.snntorch_fast``).

For ``Leaky``, ``Synaptic``, ``RLeaky``, ``RSynaptic``, ``Lapicque`` and ``Alpha`` with each
reset mechanism, learnable parameters, graded spikes and (recurrent ones) a linear,
one-to-one or convolutional recurrence: a wrapped stack run whose neurons took the fast step
(``fast_verified``) gives bitwise the spikes, membranes, final states and gradients of
snnTorch's own loop (``BPTT()``) and of the same wrapped run through the modules' own calls
(a recomputing plan). Neurons the fast step does not reproduce keep the module's call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc

snn = pytest.importorskip("snntorch")
from snntorch import surrogate  # noqa: E402

from spikeckpt.adapters.snntorch import SnnTorchNeuronAdapter  # noqa: E402
from spikeckpt.adapters.snntorch_fast import fast_step, same_results  # noqa: E402

IN, N, T, B = 5, 6, 14, 3
RESETS = ["subtract", "zero", "none"]

#: name -> factory(**kwargs) of one neuron with N units
NEURONS: dict[str, Callable[..., nn.Module]] = {
    "Leaky": lambda **kw: snn.Leaky(beta=0.8, **kw),
    "Synaptic": lambda **kw: snn.Synaptic(alpha=0.7, beta=0.8, **kw),
    "RLeaky-linear": lambda **kw: snn.RLeaky(beta=0.8, linear_features=N, **kw),
    "RLeaky-one-to-one": lambda **kw: snn.RLeaky(
        beta=0.8, all_to_all=False, V=torch.linspace(0.2, 0.9, N), **kw
    ),
    "RSynaptic-linear": lambda **kw: snn.RSynaptic(alpha=0.7, beta=0.8, linear_features=N, **kw),
    "RSynaptic-one-to-one": lambda **kw: snn.RSynaptic(
        alpha=0.7, beta=0.8, all_to_all=False, V=0.5, **kw
    ),
    "Lapicque": lambda **kw: snn.Lapicque(beta=0.85, **kw),
    "Lapicque-RC": lambda **kw: snn.Lapicque(R=2.0, C=3.0, **kw),
    "Alpha": lambda **kw: snn.Alpha(alpha=0.8, beta=0.7, **kw),
}

#: learnable parameters each class takes (Alpha(learn_alpha=True) fails in snnTorch 1.0.0,
#: Lapicque(learn_beta=True) is rejected by wrap: its C holds beta's graph)
LEARN: dict[str, dict[str, Any]] = {
    "Leaky": {"learn_beta": True, "learn_threshold": True},
    "Synaptic": {"learn_alpha": True, "learn_beta": True, "learn_threshold": True},
    "RLeaky": {"learn_beta": True, "learn_threshold": True},
    "RSynaptic": {"learn_alpha": True, "learn_beta": True, "learn_threshold": True},
    "Lapicque": {"learn_threshold": True},
    "Alpha": {"learn_beta": True, "learn_threshold": True},
}


def _net(neuron: nn.Module, graded: bool = False, conv: bool = False) -> nn.Sequential:
    """``Linear(IN, N)`` (or ``Conv2d(1, 2, 3)``) then ``neuron``, weights scaled to spike."""
    torch.manual_seed(0)
    first: nn.Module = nn.Conv2d(1, 2, 3, padding=1) if conv else nn.Linear(IN, N)
    with torch.no_grad():
        first.weight.mul_(3.0)
    if graded:  # every class has the factor (only Leaky's __init__ takes it)
        neuron.graded_spikes_factor = nn.Parameter(torch.linspace(0.5, 1.5, N))
    return nn.Sequential(first, neuron)


def _input(conv: bool = False) -> Tensor:
    torch.manual_seed(1)
    shape = (T, B, 1, 4, 4) if conv else (T, B, IN)
    return (torch.rand(shape) * 2).requires_grad_()


def _neuron_adapters(seq: Any) -> list[SnnTorchNeuronAdapter]:
    return [a for a in seq.adapter.layers if isinstance(a, SnnTorchNeuronAdapter)]


def _loss(spk: Tensor, mem: Tensor, final: tuple[Tensor, ...]) -> Tensor:
    w = torch.linspace(-1.0, 2.0, spk[0].numel()).reshape(spk[0].shape)
    return (spk * w).sum() + (mem * w.flip(-1)).sum() + sum(s.sum() * 0.25 for s in final)


def _results(spk: Tensor, mem: Tensor, final: Any, net: nn.Module, x: Tensor) -> list[Tensor]:
    """Outputs, final state and the gradients (input, parameters) of `_loss`."""
    final = tuple(final)
    params = [p for p in net.parameters() if p.requires_grad]
    grads = torch.autograd.grad(_loss(spk, mem, final), [x, *params])
    return [spk.detach(), mem.detach(), *(s.detach() for s in final), *grads]


def snntorch_loop(net: nn.Sequential, x: Tensor) -> list[Tensor]:
    """snnTorch's own loop, state passed explicitly: spikes and membranes ``(T, B, ...)``."""
    first, lif = net[0], net[1]
    names = _neuron_adapters(sc.wrap(net))[0].fields  # the state fields, in snnTorch's order
    state = tuple(torch.zeros(0) for _ in names)  # snnTorch's reset_mem: empty, then zeros
    spikes, mems = [], []
    for t in range(x.shape[0]):
        out = lif(first(x[t]), *state)
        state = out if names[0] == "spk" else out[1:]
        spikes.append(out[0])
        mems.append(state[-1])
    return _results(torch.stack(spikes), torch.stack(mems), state, net, x)


def wrapped(net: nn.Sequential, x: Tensor, plan: Any, fast: bool) -> list[Tensor]:
    """The stack granularity's run; ``fast=False``: through the modules' own calls."""
    seq = sc.wrap(net, granularity="stack", plan=plan, output="both", readout=None)
    for neuron in _neuron_adapters(seq):
        if not fast:
            neuron.fast_verified = False
    (spk, mem), state = seq(x, return_state=True)
    got = _results(spk, mem, state[1], net, x)
    if fast:
        assert all(n.fast_verified is True for n in _neuron_adapters(seq))
    return got


def assert_bitwise(got: list[Tensor], want: list[Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape, i
        assert torch.equal(a, b), (i, float((a - b).abs().max()))


def _check(net: nn.Sequential, conv: bool = False) -> None:
    x = _input(conv)
    want = snntorch_loop(net, x)
    assert want[0].sum() > 0, "no spikes: the test would not see the reset"
    assert_bitwise(wrapped(net, x, sc.plans.BPTT(), fast=True), want)
    slow = wrapped(net, x, sc.plans.Uniform(4), fast=False)
    assert_bitwise(wrapped(net, x, sc.plans.Uniform(4), fast=True), slow)


def _class_of(name: str) -> str:
    return name.split("-")[0]


@pytest.mark.parametrize("reset", RESETS)
@pytest.mark.parametrize("name", list(NEURONS))
def test_fast_step_equals_snntorch_per_reset(name: str, reset: str) -> None:
    _check(_net(NEURONS[name](reset_mechanism=reset)))


@pytest.mark.parametrize("name", list(NEURONS))
def test_fast_step_equals_snntorch_learnable(name: str) -> None:
    _check(_net(NEURONS[name](**LEARN[_class_of(name)])))


@pytest.mark.parametrize("name", list(NEURONS))
def test_fast_step_equals_snntorch_graded(name: str) -> None:
    _check(_net(NEURONS[name](learn_beta=_class_of(name) != "Lapicque"), graded=True))


@pytest.mark.parametrize("reset", RESETS)
@pytest.mark.parametrize("cls", ["RLeaky", "RSynaptic"])
def test_fast_step_with_a_convolutional_recurrence(cls: str, reset: str) -> None:
    kw: dict[str, Any] = {"conv2d_channels": 2, "kernel_size": 3, "reset_mechanism": reset}
    neuron = snn.RLeaky(beta=0.8, **kw) if cls == "RLeaky" else snn.RSynaptic(0.7, 0.8, **kw)
    _check(_net(neuron, conv=True), conv=True)


@pytest.mark.parametrize("name", ["Synaptic", "RLeaky-linear", "Alpha"])
def test_fast_step_with_other_surrogates(name: str) -> None:
    _check(_net(NEURONS[name](spike_grad=surrogate.fast_sigmoid(slope=25))))
    _check(_net(NEURONS[name](surrogate_disable=True)))


@pytest.mark.parametrize("all_to_all", [True, False])
def test_fast_step_calls_a_hooked_recurrent_map(all_to_all: bool) -> None:
    kw: dict[str, Any] = {"linear_features": N} if all_to_all else {"all_to_all": False}
    neuron = snn.RSynaptic(alpha=0.7, beta=0.8, **kw)
    neuron.recurrent.register_forward_hook(lambda mod, args, out: out * 0.5)
    _check(_net(neuron))


def test_fast_step_with_init_hidden() -> None:
    net = _net(snn.RSynaptic(alpha=0.7, beta=0.8, linear_features=N, init_hidden=True))
    x = _input()
    slow = wrapped(net, x, sc.plans.Uniform(4), fast=False)
    assert_bitwise(wrapped(net, x, sc.plans.Uniform(4), fast=True), slow)


class _MySynaptic(snn.Synaptic):
    pass


def _quantized(**kw: Any) -> nn.Module:
    from snntorch.functional import quant

    return snn.Synaptic(alpha=0.7, beta=0.8, state_quant=quant.state_quant(num_bits=4), **kw)


REFUSED: dict[str, Callable[[], nn.Module]] = {
    "state_quant": _quantized,
    "subclass": lambda: _MySynaptic(alpha=0.7, beta=0.8),
    "reset_delay": lambda: snn.RLeaky(beta=0.8, linear_features=N, reset_delay=False),
    "inhibition": lambda: snn.Synaptic(alpha=0.7, beta=0.8, inhibition=True),
    "instance-forward": lambda: _own_forward(snn.Alpha(alpha=0.8, beta=0.7)),
    "state-function": lambda: _own_state_function(snn.Synaptic(alpha=0.7, beta=0.8)),
    "SLSTM": lambda: snn.SLSTM(N, N),
}


def _own_forward(m: nn.Module) -> nn.Module:
    m.forward = type(m).forward.__get__(m)  # type: ignore[method-assign]
    return m


def _own_state_function(m: Any) -> nn.Module:
    m.state_function = lambda x: m._base_int(x)
    return m


@pytest.mark.filterwarnings("ignore:Inhibition is an unstable feature")
@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_neurons_keep_the_module_call(case: str) -> None:
    neuron = REFUSED[case]()
    assert fast_step(neuron, tuple) is None
    net = _net(neuron)
    calls: list[int] = []
    seq = sc.wrap(net, granularity="stack", plan=sc.plans.BPTT())
    for adapter in _neuron_adapters(seq):
        adapter.module_step = _counting(adapter.module_step, calls)  # type: ignore[method-assign]
    seq(_input().detach())
    assert len(calls) == T
    assert all(a.fast_verified is None for a in _neuron_adapters(seq))


def test_no_fast_step_for_another_neurons_state_function() -> None:
    """A state function bound to another neuron computes with that one's tensors."""
    m = snn.RLeaky(beta=0.8, linear_features=N)
    assert fast_step(m, tuple) is not None
    m.state_function = snn.RLeaky(beta=0.5, linear_features=N)._base_sub
    assert fast_step(m, tuple) is None


def _counting(step: Any, calls: list[int]) -> Any:
    def counted(*args: Any) -> Any:
        calls.append(1)
        return step(*args)

    return counted


def test_same_results_sees_a_wrong_field() -> None:
    """The check draws every state field: a step off in ``syn`` (not the output) is caught."""
    net = _net(snn.RSynaptic(alpha=0.7, beta=0.8, linear_features=N))
    adapter = _neuron_adapters(sc.wrap(net))[0]
    good = adapter._fast
    assert good is not None and same_results(adapter.module_step, good, adapter)

    def off(state: Any, x: Tensor) -> Any:
        new, y = good(state, x)
        return new._replace(syn=new.syn * (1 + 2**-20)), y

    def ignores_spk(state: Any, x: Tensor) -> Any:
        return good(state._replace(spk=torch.zeros_like(state.spk)), x)

    assert not same_results(adapter.module_step, off, adapter)
    assert not same_results(adapter.module_step, ignores_spk, adapter)


@pytest.mark.slow  # compiles for a few seconds
def test_the_compiled_stack_step_traces_no_snntorch_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``compile=True``: after the first call (the checks) no snnTorch ``forward`` runs, the
    step is one graph (torch 2.11's dynamo broke it at ``if not syn == None:``), the outputs
    bitwise the eager run's."""
    from torch._dynamo.utils import counters

    from spikeckpt.engine import compiled

    if compiled.compiler_missing("cpu") is not None:
        pytest.skip("no C++ compiler for inductor")
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(IN, N),
        snn.Synaptic(alpha=0.7, beta=0.8),
        nn.Linear(N, N),
        snn.RLeaky(beta=0.8, linear_features=N, reset_mechanism="zero"),
        nn.Linear(N, N),
        snn.RSynaptic(alpha=0.7, beta=0.8, all_to_all=False, V=0.5),
        nn.Linear(N, N),
        snn.Alpha(alpha=0.8, beta=0.7),
        nn.Linear(N, N),
        snn.Lapicque(beta=0.85, reset_mechanism="zero"),
    )
    with torch.no_grad():
        for layer in net[::2]:
            layer.weight.mul_(3.0)
    calls: list[str] = []
    for cls in {type(m) for m in net[1::2]}:
        own = cls.forward

        def counted(self: nn.Module, *args: Any, _own: Any = own) -> Any:
            calls.append(type(self).__name__)
            return _own(self, *args)

        monkeypatch.setattr(cls, "forward", counted)
    x = _input()
    runs = {}
    for flag in (False, True):
        seq = sc.wrap(net, granularity="stack", plan=sc.plans.BPTT(), compile=flag)
        seq(x)  # the first call checks the fast steps against the modules' calls
        assert all(n.fast_verified is True for n in _neuron_adapters(seq))
        calls.clear()
        counters.clear()
        net.zero_grad(set_to_none=True)
        y = seq(x)
        (y * torch.linspace(-1, 1, N)).sum().backward()
        assert calls == []
        assert seq.last_stats.step_compiled is flag
        runs[flag] = [y.detach(), *(p.grad.clone() for p in net.parameters())]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert torch.equal(runs[True][0], runs[False][0])
    # gradients at float32 round-off: inductor sums some in its own order (RLeaky zero reset)
    scale = max(float(g.abs().max()) for g in runs[False][1:])
    for got, want in zip(runs[True][1:], runs[False][1:], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale)
