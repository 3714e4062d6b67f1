"""Mixed precision against the framework's own plain loop, run the same way (found by a
differential fuzzer of ``wrap`` under CPU autocast and half-precision models):

- Norse's ``p`` is used in its own dtype, as Norse's loop uses it: the adapter cast it to the
  input's dtype (bf16 under autocast: ``dt * tau_mem_inv`` = 0.1001, not 0.1), a LIFCell's
  membrane 7e-4 off the loop's under bf16 autocast, 1.2e-4 under fp16, 5e-9 in a float64 model;
- layer-wise never gathers a ``Linear``'s sparse input under autocast: the loop's ``Linear``
  runs in bf16/fp16 there, the float32 gather gave other synaptic inputs (an snnTorch top
  membrane 0.21 off the loop's) and, for a chunk without spikes into a Norse ``LICell``, a
  float32 output where the loop's is fp16.

Outputs are compared bitwise (the forward of a checkpointed run is the loop's forward);
gradients to the reduced precision's round-off of their largest magnitude (a plan sums a
parameter's gradient in another order, and autocast's weight copy accumulates in bf16/fp16).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snn_loops import leaky_loop as _snn_loop
from torch import Tensor, nn

import spikeckpt as sc

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    snn = pytest.importorskip("snntorch")
    nt = pytest.importorskip("norse.torch")

#: gradient tolerance, of each gradient's largest magnitude (bf16: 8 significant bits)
RTOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float64: 1e-12}
MODES = ["bf16-autocast", "fp16-autocast", "float64-model"]


def _context(mode: str) -> Any:
    if mode.endswith("autocast"):
        dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float16
        return torch.autocast("cpu", dtype=dtype)
    return contextlib.nullcontext()


def _dtype(mode: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode[:4], torch.float64)


def _norse_loop(net: nn.Sequential, x: Tensor) -> tuple[Tensor, Tensor]:
    """Norse's tutorials' loop: ``z, state = cell(x_t, state)`` from ``state=None``; the top
    cell's ``(outputs (T, B, n), membranes (T, B, n))``."""
    states: list[Any] = [None] * len(net)
    ys, mems = [], []
    for x_t in x:
        h = x_t
        for i, layer in enumerate(net):
            if type(layer).__module__.startswith("norse"):
                h, states[i] = layer(h, states[i])
            else:
                h = layer(h)
        ys.append(h)
        mems.append(states[-1].v)
    return torch.stack(ys), torch.stack(mems)


def _grads(out: tuple[Tensor, Tensor], net: nn.Module) -> list[Tensor]:
    _, mem = out
    weights = torch.linspace(-1, 1, mem.numel()).reshape(mem.shape)
    params = list(net.parameters())
    return list(torch.autograd.grad((mem.float() * weights).sum(), params, allow_unused=True))


def _compare(
    build: Callable[[], nn.Sequential],
    loop: Callable[[nn.Sequential, Tensor], tuple[Tensor, Tensor]],
    x: Tensor,
    mode: str,
    **wrap_kwargs: Any,
) -> None:
    """The wrapped run's (outputs, membranes) bitwise the loop's, same dtypes; gradients to
    the mode's round-off."""
    torch.manual_seed(0)
    net = build()
    if mode == "float64-model":
        net, x = net.double(), x.double()
    wrapped = copy.deepcopy(net)
    with _context(mode):
        want = loop(net, x)
        got = sc.wrap(wrapped, output="both", **wrap_kwargs)(x)
    for a, b, what in zip(want, got, ("outputs", "membranes"), strict=True):
        assert a.dtype == b.dtype, f"{what}: {b.dtype}, the loop's {a.dtype}"
        assert torch.equal(a, b), f"{what} differ by {(a.double() - b.double()).abs().max()}"
    rtol = RTOL[_dtype(mode)]
    for a, b in zip(_grads(want, net), _grads(got, wrapped), strict=True):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert float((a - b).abs().max()) <= rtol * float(a.abs().max()) + 1e-30


NORSE_CELLS = {"LIFCell": nt.LIFCell, "LIFBoxCell": nt.LIFBoxCell, "LICell": nt.LICell}


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cell", sorted(NORSE_CELLS))
def test_norse_parameters_keep_their_dtype(cell: str, mode: str, granularity: str) -> None:
    """LIFCell's membrane was 7e-4 (bf16 autocast), 1.2e-4 (fp16) and 5e-9 (float64 model)
    off Norse's own loop, in both granularities."""

    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 5), NORSE_CELLS[cell]())

    x = (torch.rand(9, 2, 4, generator=torch.Generator().manual_seed(1)) < 0.5).float()
    _compare(build, _norse_loop, x, mode, plan=sc.plans.Uniform(4), granularity=granularity)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(["bf16-autocast", "fp16-autocast"]),
    T=st.integers(1, 12),
    batch=st.integers(1, 3),
    density=st.sampled_from([0.0, 0.02, 0.05]),
    packed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_layerwise_sparse_input_under_autocast_is_the_loops(
    dtype: str, T: int, batch: int, density: float, packed: bool, seed: int
) -> None:
    """Input spikes at most 1 in 16 (where layer-wise gathers a Linear's input on the CPU),
    ``exact=False``: bitwise the loop's under autocast (an snnTorch top membrane was 0.21
    off, from float32 synaptic inputs where the loop's are bf16)."""

    def build() -> nn.Sequential:
        return nn.Sequential(
            nn.Linear(64, 16), snn.Leaky(beta=0.9, threshold=0.3),
            nn.Linear(16, 8), snn.Leaky(beta=0.8, threshold=0.2),
        )  # fmt: skip

    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(T, batch, 64, generator=g) < density).float()
    torch.manual_seed(seed)
    net = build()
    wrapped = copy.deepcopy(net)
    with _context(dtype):
        want = _snn_loop(net, x)
        inp = sc.SpikeTrain.from_dense(x) if packed else x
        got = sc.wrap(wrapped, granularity="layer", plan=sc.plans.Uniform(5), output="both")(inp)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()
    rtol = RTOL[_dtype(dtype)]
    for a, b in zip(_grads(want, net), _grads(got, wrapped), strict=True):
        assert float((a - b).abs().max()) <= rtol * float(a.abs().max()) + 1e-30


@pytest.mark.parametrize("mode", ["bf16-autocast", "fp16-autocast"])
def test_a_chunk_without_spikes_keeps_the_autocast_dtype(mode: str) -> None:
    """A Norse LICell behind a Linear, an input without spikes: the loop's membrane is fp16
    (bf16); the wrapped run's was float32 (the gather of no input)."""

    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 5), nt.LICell())

    x = torch.zeros(3, 2, 4)
    _compare(build, _norse_loop, x, mode, plan=sc.plans.BPTT(), granularity="layer")


HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _half_model(neuron: str, dtype: torch.dtype) -> tuple[nn.Sequential, Tensor]:
    torch.manual_seed(0)
    lif = snn.Leaky(beta=0.9) if neuron == "Leaky" else snn.Lapicque(beta=0.8)
    net = nn.Sequential(nn.Linear(4, 6), lif).to(dtype)
    return net, (torch.rand(12, 2, 4) < 0.5).to(dtype)


def _init_loop(net: nn.Sequential, x: Tensor) -> tuple[Tensor, Tensor]:
    """snnTorch's explicit-state loop from its own ``init_leaky()`` / ``init_lapicque()``
    (a float32 empty state): ``(spikes, membranes)``."""
    lif = net[1]
    mem = lif.init_leaky() if isinstance(lif, snn.Leaky) else lif.init_lapicque()
    ys, mems = [], []
    for x_t in x:
        y, mem = lif(net[0](x_t), mem)
        ys.append(y)
        mems.append(mem)
    return torch.stack(ys), torch.stack(mems)


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("neuron", ["Leaky", "Lapicque"])
@pytest.mark.parametrize("half", list(HALF))
def test_a_half_precision_model_whose_state_step_0_widens_runs_as_the_loop(
    half: str, neuron: str, granularity: str
) -> None:
    """An fp16/bf16 model (no autocast) with snnTorch's explicit state: its reset (a float32
    spike) makes step 0 return a float32 membrane from the model-dtype start. The stack
    granularity refused it ("step 0 changed state ... float32 ... float16", pointing at
    torch.autocast); scan now runs step 0 apart whenever an untaped step 0 changes a state
    dtype: outputs and membranes bitwise the loop's, gradients to the precision's round-off."""
    net, x = _half_model(neuron, HALF[half])
    wrapped = copy.deepcopy(net)
    want = _init_loop(net, x)
    want_grads = _grads(want, net)
    want = tuple(t.detach() for t in want)
    for plan in (sc.plans.Uniform(4), "auto"):
        wrapped.zero_grad()
        got = sc.wrap(wrapped, plan=plan, granularity=granularity, output="both")(x)
        for a, b in zip(want, got, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), plan
        rtol = RTOL[HALF[half]]
        for a, b in zip(want_grads, _grads(got, wrapped), strict=True):
            assert float((a - b).abs().max()) <= rtol * float(a.abs().max()) + 1e-30, plan


@pytest.mark.parametrize("plan", [sc.plans.BPTT(), sc.plans.Uniform(4), "auto"])
@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_a_float64_option_buffer_in_a_float32_model_runs_as_the_loop(
    granularity: str, plan: Any
) -> None:
    """``snn.Leaky(beta=torch.from_numpy(...))``: a float64 buffer that makes the membrane
    float64 at step 0. The stack refused it (the dtypes step 0 looks at left out buffers)
    with advice about a Schedule none was given; now step 0 runs apart, as for fp16."""
    beta = torch.from_numpy(np.linspace(0.5, 0.95, 12))

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        top = snn.Leaky(beta=0.9, threshold=0.1)
        return nn.Sequential(nn.Linear(10, 12), snn.Leaky(beta=beta), nn.Linear(12, 5), top)

    torch.manual_seed(1)
    x = torch.rand(13, 3, 10) * 6
    net, wrapped = make(), make()
    want = _snn_loop(net, x)
    assert want[0].any(), "the top layer spikes"
    got = sc.wrap(wrapped, plan=plan, granularity=granularity, output="both")(x)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    sum(t.sum() for t in want).backward()
    sum(t.sum() for t in got).backward()
    for a, b in zip(net.parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5)


def test_a_schedule_for_all_steps_names_the_step_that_widens_the_state() -> None:
    """Where step 0 cannot run apart (a Schedule built for all T steps), the refusal names
    the real cause (the step returns another dtype), not autocast, and the fix."""
    net, x = _half_model("Leaky", torch.float16)
    seq = sc.wrap(net, plan=sc.plans.Uniform(4).schedule(12), granularity="stack")
    with pytest.raises(sc.errors.ConfigError) as info:
        seq(x)
    message = str(info.value)
    assert "step 0 returns this state in torch.float32 from a torch.float16 one" in message
    assert "build it for T-1, or pass an initial state in torch.float32" in message


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("kind", ["SLSTM", "SConv2dLSTM"])
def test_snntorch_lstm_states_start_in_the_default_dtype_under_autocast(
    kind: str, granularity: str
) -> None:
    """snnTorch starts an ``SLSTM`` / ``SConv2dLSTM`` state with ``torch.zeros`` (float32);
    the adapter took the input's dtype (bf16 under autocast): membranes 1.6e-3 and synaptic
    currents 3.7e-3 off the loop's, in bf16 where the loop's are float32. Bitwise now."""
    from snntorch import utils

    def build() -> nn.Module:
        torch.manual_seed(1)
        if kind == "SLSTM":
            return nn.Sequential(
                nn.Linear(8, 6),
                snn.SLSTM(6, 6, init_hidden=True),
                nn.Linear(6, 5),
                snn.SLSTM(5, 5, init_hidden=True, output=True),
            )
        return nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1),
            snn.SConv2dLSTM(3, 4, 3, init_hidden=True, output=True),
        )

    torch.manual_seed(0)
    x = torch.rand(20, 2, 8) * 1.5 if kind == "SLSTM" else torch.rand(20, 2, 2, 6, 6) * 1.5
    loop, net = build(), build()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        utils.reset(loop)
        outs = [loop(x_t) for x_t in x]
        want = [torch.stack([o[k] for o in outs]) for k in range(3)]
        got = sc.wrap(net, plan=sc.plans.Uniform(4), granularity=granularity)(x)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    (want[2].float().sum() + want[0].sum()).backward()
    (got[2].float().sum() + got[0].sum()).backward()
    for p, q in zip(loop.parameters(), net.parameters(), strict=True):
        scale = float(p.grad.abs().max()) or 1.0
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=RTOL[torch.bfloat16] * scale)


@pytest.mark.parametrize("plan", [sc.plans.BPTT(), sc.plans.Uniform(4)])
def test_a_state_whose_dtype_settles_a_step_later_runs_as_the_loop(plan: Any) -> None:
    """snnTorch's ``DeltaLeaky`` keeps the previous membrane: under bf16 autocast its
    ``mem_prev`` is float32 zeros until step 1 has made it bf16. Only step 0 ran apart, and
    the stack refused the run with a message about a Schedule the user never built. The steps
    whose state still changes dtype now run apart (up to three)."""
    T, B = 30, 3
    torch.manual_seed(0)
    x = torch.rand(T, B, 8) * 1.5

    def build() -> nn.Module:
        torch.manual_seed(1)
        beta = torch.full((6,), 0.9)
        return nn.Sequential(nn.Linear(8, 6), snn.DeltaLeaky(beta=beta, delta_threshold=0.3))

    neurons = list(snn.SpikingNeuron.instances)  # snnTorch keeps every neuron built, and
    loop, net = build(), build()  # a DeltaLeaky never called (mem None) breaks utils.reset
    try:
        _check_delta_leaky(loop, net, x, plan)
    finally:
        snn.SpikingNeuron.instances[:] = neurons


def _check_delta_leaky(loop: nn.Module, net: nn.Module, x: Tensor, plan: Any) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state, outs = (None, None), []
        for x_t in x:
            spk, state = loop[1](loop[0](x_t), state)
            outs.append(spk)
        got = sc.wrap(net, plan=plan)(x)
    want = torch.stack(outs)
    assert got.dtype == want.dtype and torch.equal(got, want)
    (want * torch.arange(1.0, 7.0)).sum().backward()
    (got * torch.arange(1.0, 7.0)).sum().backward()
    for p, q in zip(loop.parameters(), net.parameters(), strict=True):
        scale = float(p.grad.abs().max()) or 1.0
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=RTOL[torch.bfloat16] * scale)


@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_an_fp16_input_that_requires_grad_under_bf16_autocast_backpropagates(
    granularity: str,
) -> None:
    """The engine took each segment's gradients under the forward's autocast (it re-enters
    it to recompute): the backward of an fp16 input that requires grad under bf16 autocast
    failed in the stack ("Unexpected floating ScalarType in at::autocast::prioritize") where
    the loop's backward, outside autocast, runs. The gradients now run as the loop's."""
    from snntorch import utils

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(8, 6),
            snn.Leaky(0.9, init_hidden=True),
            nn.Linear(6, 5),
            snn.Leaky(0.8, init_hidden=True, output=True),
        )

    torch.manual_seed(5)
    x0 = (torch.rand(20, 3, 8) * 2).half()
    loop, net = build(), build()
    x_loop, x_net = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        utils.reset(loop)
        mem = torch.stack([loop(x_t)[1] for x_t in x_loop])
        _, got = sc.wrap(net, plan=sc.plans.Uniform(4), granularity=granularity)(x_net)
    assert torch.equal(got, mem)
    mem.sum().backward()
    got.sum().backward()
    assert x_net.grad is not None and x_net.grad.dtype == torch.float16
    torch.testing.assert_close(x_net.grad, x_loop.grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    "plan", [sc.plans.BPTT(), sc.plans.Uniform(3), sc.plans.Revolve(3)], ids=repr
)
def test_under_autocast_grad_stays_none_where_the_loop_leaves_it(plan: Any) -> None:
    """Norse ``Linear -> LIFCell -> CobaLIFCell``: no gradient reaches the ``Linear`` in the
    loop (``.grad`` None). Under bf16 autocast scan ran step 0 apart, whatever the dtypes,
    and handed its state to the run: autograd then reached step 0's graph through every
    state leaf and gave the ``Linear`` zeros, which AdamW's weight decay applied (0.00223)."""
    norse = pytest.importorskip("norse.torch")

    def build() -> nn.Module:
        torch.manual_seed(0)
        return norse.SequentialState(nn.Linear(20, 16), norse.LIFCell(), norse.CobaLIFCell(16, 4))

    g = torch.Generator().manual_seed(3)
    x = (torch.rand(14, 3, 20, generator=g) < 0.4).float() * 1.5
    loop, wrapped = build(), build()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state, outs = None, []
        for x_t in x:
            v, state = loop(x_t, state)
            outs.append(v)
        want = torch.stack(outs)
        got, _ = sc.wrap(wrapped, plan=plan)(x)
    want.float().sum().backward()
    got.float().sum().backward()
    for (name, a), b in zip(loop.named_parameters(), wrapped.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
