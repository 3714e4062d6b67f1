"""Model zoo, the edges users reach (issue 25), each against its own plain loop:

- mixed precision: ``torch.autocast`` (CPU bf16; CUDA fp16/bf16 where a GPU is present) through
  ``wrap`` (stack and layer-wise) and ``scan`` (``init_leaky()`` states, a constant input),
  snnTorch and Norse; a Lightning ``Trainer(precision="bf16-mixed")`` with ``MemoryBudget``;
- Norse ``SequentialState(return_hidden=True)`` (every layer's output) and
  ``record_states=True`` (refused);
- ``readout="max"`` / ``"min"``: ``max(0)``'s value and gradient with ties in the data (and
  NaNs), in both granularities and scan's step-0 prelude; the folds the docs show;
- learnable tensors that are not ``nn.Parameter``s, found or refused naming the layer;
- call sites: a net ending with an snnTorch ``output=True`` neuron returns what its per-step
  call returned, stacked; ``scan(..., steps=n)`` for the same input at every step.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from zoo_common import MEASURED, PLAN_IDS, PLANS, check

import spikeckpt as sc
from spikeckpt.engine.readout import Reducer
from spikeckpt.errors import UnlistedParamsError, UnsupportedLayerError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    snn = pytest.importorskip("snntorch")
    nt = pytest.importorskip("norse.torch")
    from snntorch import utils as snn_utils  # noqa: E402

T, B = 7, 3
CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _forget_neurons() -> Any:
    """snnTorch keeps every neuron ever built in a class-level list that ``utils.reset``
    walks, and a ``DeltaLeaky`` never called breaks it there (its ``mem`` is None): later
    tests in this process must not see this test's neurons."""
    before = list(snn.SpikingNeuron.instances)
    yield
    snn.SpikingNeuron.instances[:] = before


GRANULARITIES = ["stack", "layer"]

# ----------------------------------------------------------------------------- helpers


def _leaves(out: Any) -> list[Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.is_floating_point()]


def _loss(out: Any) -> Tensor:
    g = torch.Generator().manual_seed(7)
    leaves = _leaves(out)
    return sum(
        (leaf.float() * torch.randn(leaf.shape, generator=g).to(leaf.device)).sum()
        for leaf in leaves
    )  # type: ignore[return-value]


def _grads(tensors: list[Tensor]) -> list[Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def compare_reduced(
    build: Callable[[], nn.Module],
    loop: Callable[[nn.Module, Any], Any],
    route: Callable[[nn.Module, Any], Any],
    x: Any,
    name: str,
    *,
    rtol: float,
    context: Callable[[], Any],
) -> tuple[float, float]:
    """Outputs bitwise (the forward of a checkpointed run is the loop's), gradients to
    ``rtol`` of each gradient's largest magnitude (the reduced precision's round-off); both
    runs under ``context()`` (an autocast). Records the largest differences in ``MEASURED``."""
    torch.manual_seed(0)
    model = build()
    results = []
    for fn in (loop, route):
        m = copy.deepcopy(model)
        torch.manual_seed(0)
        with context():
            out = fn(m, x)
        _loss(out).backward()
        results.append((_leaves(out), _grads(list(m.parameters()))))
    (ref_out, ref_g), (got_out, got_g) = results
    assert len(ref_out) == len(got_out)
    for a, b in zip(ref_out, got_out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"outputs differ by {(a.float() - b.float()).abs().max()}"
    worst = 0.0
    assert any(g is not None and g.abs().sum() > 0 for g in ref_g)
    for a, b in zip(ref_g, got_g, strict=True):
        if a is None or b is None:
            assert (a if b is None else b) is None or not (a if b is None else b).any()
            continue
        scale = float(a.abs().max()) or 1.0
        rel = float((a - b).abs().max()) / scale
        worst = max(worst, rel)
        assert rel <= rtol, f"{name}: gradient differs by {rel:.3g} of its largest magnitude"
    old = MEASURED.get(name, (0.0, 0.0))
    MEASURED[name] = (old[0], max(old[1], worst))
    return 0.0, worst


def snn_net(output: bool = False, hidden: bool = True) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 8),
        snn.Leaky(beta=0.9, learn_beta=True, init_hidden=hidden),
        nn.Linear(8, 4),
        snn.Leaky(beta=0.8, init_hidden=hidden, output=output),
    )


def snn_hidden_loop(net: nn.Module, x: Tensor) -> Any:
    """Tutorials 6/7: ``init_hidden=True`` neurons, one call per step after ``utils.reset``."""
    snn_utils.reset(net)
    outs = [net(x[t]) for t in range(x.shape[0])]
    if isinstance(outs[0], tuple):
        return pytree.tree_map(lambda *ys: torch.stack(ys), *outs)
    return torch.stack(outs)


def snn_explicit_loop(net: nn.Module, x: Tensor) -> Tensor:
    """Tutorial 5's style: explicit membranes from ``init_leaky()``."""
    fc1, lif1, fc2, lif2 = net
    mem1, mem2 = lif1.init_leaky(), lif2.init_leaky()
    spikes = []
    for t in range(x.shape[0]):
        spk1, mem1 = lif1(fc1(x[t]), mem1)
        spk2, mem2 = lif2(fc2(spk1), mem2)
        spikes.append(spk2)
    return torch.stack(spikes)


def norse_net(return_hidden: bool = False) -> nn.Module:
    return nt.SequentialState(
        nn.Linear(6, 8), nt.LIFCell(), nn.Linear(8, 4), nt.LICell(), return_hidden=return_hidden
    )


def norse_loop(net: nn.Module, x: Tensor) -> Any:
    state, outs = None, []
    for t in range(x.shape[0]):
        y, state = net(x[t], state)
        outs.append(y)
    return pytree.tree_map(lambda *ys: torch.stack(ys), *outs)


def _spikes(shape: tuple[int, ...], p: float = 0.4, device: str = "cpu") -> Tensor:
    g = torch.Generator().manual_seed(3)
    return (torch.rand(shape, generator=g) < p).float().to(device)


def _autocast(device: str, dtype: torch.dtype, cache: bool = True) -> Callable[[], Any]:
    return lambda: torch.autocast(device, dtype=dtype, cache_enabled=cache)


# ----------------------------------------------------------------------------- 1. autocast

#: bf16 has 8 significant bits: 2**-8 = 0.0039 per rounding; a gradient sums T steps of them
BF16_RTOL = 2e-2
FP16_RTOL = 5e-3


@pytest.mark.parametrize("cache", [True, False], ids=["cast-cache", "no-cache"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_autocast_bf16_snntorch_wrap(plan: Any, granularity: str, cache: bool) -> None:
    """Stack granularity failed here before ("step 0 changed state[1].mem"): snnTorch returns
    a float32 membrane from the bf16 input of the previous Linear."""
    x = _spikes((T, B, 6))

    def route(m: nn.Module, x: Tensor) -> Tensor:
        return sc.wrap(m, plan=plan, granularity=granularity)(x)

    compare_reduced(
        snn_net, snn_hidden_loop, route, x, f"bf16 autocast snnTorch {granularity}",
        rtol=BF16_RTOL, context=_autocast("cpu", torch.bfloat16, cache),
    )  # fmt: skip


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_autocast_bf16_snntorch_explicit_state(granularity: str) -> None:
    x = _spikes((T, B, 6))

    def route(m: nn.Module, x: Tensor) -> Tensor:
        return sc.wrap(m, plan=sc.plans.Uniform(3), granularity=granularity)(x)

    compare_reduced(
        lambda: snn_net(hidden=False), snn_explicit_loop, route, x,
        f"bf16 autocast snnTorch explicit {granularity}",
        rtol=BF16_RTOL, context=_autocast("cpu", torch.bfloat16),
    )  # fmt: skip


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_autocast_bf16_norse_wrap(plan: Any, granularity: str) -> None:
    x = _spikes((T, B, 6))

    def route(m: nn.Module, x: Tensor) -> Tensor:
        return sc.wrap(m, plan=plan, granularity=granularity)(x)[0]

    compare_reduced(
        norse_net, lambda m, x: norse_loop(m, x), route, x,
        f"bf16 autocast Norse {granularity}", rtol=BF16_RTOL,
        context=_autocast("cpu", torch.bfloat16),
    )  # fmt: skip


@pytest.mark.parametrize("readout", [None, "sum", "max"])
def test_autocast_bf16_scan_from_init_leaky_with_a_constant_input(readout: Any) -> None:
    """Tutorial 5 under autocast: ``init_leaky()`` states, the same image at every step."""
    x = torch.rand(B, 6)

    def loop(m: nn.Module, x: Tensor) -> Any:
        fc1, lif1, fc2, lif2 = m
        mem1, mem2 = lif1.init_leaky(), lif2.init_leaky()
        mems = []
        for _ in range(T):
            spk1, mem1 = lif1(fc1(x), mem1)
            _, mem2 = lif2(fc2(spk1), mem2)
            mems.append(mem2)
        v = torch.stack(mems)
        total = mems[0]
        for m in mems[1:]:  # the sum readout adds in time order
            total = total + m
        return {None: v, "sum": total, "max": v.max(0).values}[readout]

    def route(m: nn.Module, x: Tensor) -> Any:
        fc1, lif1, fc2, lif2 = m

        def step(state: Any, x_t: Tensor) -> Any:
            mem1, mem2 = state
            spk1, mem1 = lif1(fc1(x_t), mem1)
            _, mem2 = lif2(fc2(spk1), mem2)
            return (mem1, mem2), mem2

        state = (lif1.init_leaky(), lif2.init_leaky())
        ys, final = sc.scan(step, x, state, steps=T, plan=sc.plans.Revolve(2), readout=readout)
        assert final[0].dtype == torch.float32  # the dtype snnTorch's step gives
        return ys

    compare_reduced(
        lambda: snn_net(hidden=False), loop, route, x, "bf16 autocast scan tutorial 5",
        rtol=BF16_RTOL, context=_autocast("cpu", torch.bfloat16),
    )  # fmt: skip


def test_autocast_budget_counts_the_reduced_precision_bytes() -> None:
    """The planner's step model (measured under the forward's autocast) counts bf16 tapes and
    the float32 state snnTorch carries."""
    from spikeckpt.planning import probe_model

    seq = sc.wrap(snn_net(), plan=sc.plans.Uniform(3))
    x = _spikes((T, 16, 6))
    full = probe_model(seq, x, seq.initial_state(x[0]), "host")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = probe_model(seq, x, seq.initial_state(x[0]), "host")
    assert half.step_bytes < full.step_bytes
    assert half.state_bytes == full.state_bytes == 16 * (8 + 4) * 4  # float32 membranes


@pytest.mark.slow
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_lightning_bf16_mixed_trains_within_the_budget(tmp_path: Path, granularity: str) -> None:
    pytest.importorskip("lightning")
    from test_lightning import SpikingClassifier, _loader, _needs, _trainer

    from spikeckpt.lightning import MemoryBudget

    length = 60
    model = SpikingClassifier(granularity=granularity)
    bptt, fixed = _needs(model, length)
    budget = fixed + bptt // 4
    callback = MemoryBudget(budget, measure_batches=2)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(callback, tmp_path, precision="bf16-mixed")
    trainer.fit(model, _loader(length, batches=2))
    (choice,) = callback.plans.values()
    assert choice.granularity == granularity
    assert model.net.last_stats is not None and model.net.last_stats.completed
    assert callback.measured_peak_bytes is not None and callback.measured_peak_bytes <= budget
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_autocast_cuda(dtype: torch.dtype, granularity: str) -> None:
    x = _spikes((T, B, 6), device="cuda")

    def build() -> nn.Module:
        return snn_net().cuda()

    def route(m: nn.Module, x: Tensor) -> Tensor:
        return sc.wrap(m, plan=sc.plans.Uniform(3), granularity=granularity)(x)

    compare_reduced(
        build, snn_hidden_loop, route, x, f"CUDA autocast {dtype} {granularity}",
        rtol=BF16_RTOL if dtype == torch.bfloat16 else FP16_RTOL,
        context=_autocast("cuda", dtype),
    )  # fmt: skip


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_lightning_16_mixed_cuda(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from test_lightning import SpikingClassifier, _loader, _trainer

    from spikeckpt.lightning import MemoryBudget

    model = SpikingClassifier()
    callback = MemoryBudget("1GiB", measure_batches=2)
    trainer = _trainer(callback, tmp_path, precision="16-mixed", accelerator="gpu")
    trainer.fit(model, _loader(60, batches=2))
    assert model.net.last_stats is not None and model.net.last_stats.completed


# ----------------------------------------------------------------------------- 2. Norse returns


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_norse_return_hidden_gives_every_layer_over_time(plan: Any) -> None:
    x = _spikes((T, B, 6))

    def route(m: nn.Module, x: Tensor) -> Any:
        hidden, _ = sc.wrap(m, plan=plan)(x)
        assert isinstance(hidden, list) and len(hidden) == 4  # every position, Norse's order
        assert [h.shape[:2] for h in hidden] == [(T, B)] * 4
        return hidden

    check(lambda: norse_net(True), norse_loop, route, x, "Norse return_hidden")


def test_norse_return_hidden_sequence_modules() -> None:
    x = _spikes((T, B, 6))

    def build() -> nn.Module:
        return nt.SequentialState(
            nt.Lift(nn.Linear(6, 8)), nt.LIF(), nt.Lift(nn.Linear(8, 4)), nt.LI(),
            return_hidden=True,
        )  # fmt: skip

    check(build, lambda m, x: m(x)[0], lambda m, x: sc.wrap(m, plan=sc.plans.Uniform(3))(x)[0], x)


def test_norse_return_hidden_refuses_layerwise_and_auto_takes_the_stack() -> None:
    x = _spikes((T, B, 6))
    with pytest.raises(UnsupportedLayerError, match="return_hidden=True.*granularity='stack'"):
        sc.wrap(norse_net(True), granularity="layer")
    seq = sc.wrap(norse_net(True), granularity="auto", budget="64MiB")
    hidden, _ = seq(x)
    assert len(hidden) == 4 and seq.last_decision is not None
    assert seq.last_decision.granularity == "stack"


def test_norse_record_states_is_refused_naming_the_layer() -> None:
    model = nt.SequentialState(nn.Linear(6, 4), nt.LIF(record_states=True))
    with pytest.raises(UnsupportedLayerError, match=r"'1'.*record_states=True.*output='mem'"):
        sc.wrap(model, plan=sc.plans.Uniform(3))(_spikes((T, B, 6)))


# ----------------------------------------------------------------------------- 3. max readout


def tie_net() -> nn.Sequential:
    """A readout that ties: a bias-free Linear into a leaky integrator (no reset) stays at
    exactly 0 until its first input spike."""
    return nn.Sequential(
        nn.Linear(6, 8),
        snn.Leaky(beta=0.9, init_hidden=True),
        nn.Linear(8, 5, bias=False),
        snn.Leaky(beta=0.9, init_hidden=True, reset_mechanism="none", output=True),
    )


def mem_loop(kind: str) -> Callable[[nn.Module, Tensor], Tensor]:
    def loop(net: nn.Module, x: Tensor) -> Tensor:
        _, mem = snn_hidden_loop(net, x)
        return mem.max(0).values if kind == "max" else mem.min(0).values

    return loop


def _tie_input() -> Tensor:
    x = _spikes((T, B, 6), p=0.15)
    x[:3] = 0  # the first steps silent: ties at 0 in every unit
    return x


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_max_readout_with_ties(plan: Any, granularity: str, kind: str) -> None:
    x = _tie_input()
    torch.manual_seed(0)
    _, mem = snn_hidden_loop(tie_net(), x)
    extremum = mem.max(0).values if kind == "max" else mem.min(0).values
    assert int((mem == extremum).sum(0).max()) > 1  # the data has ties

    def route(m: nn.Module, x: Tensor) -> Tensor:
        return sc.wrap(m, plan=plan, granularity=granularity, output="mem", readout=kind)(x)

    check(tie_net, mem_loop(kind), route, x, f"readout={kind} (ties) {granularity}")


@pytest.mark.parametrize("kind", ["max", "min"])
def test_max_readout_in_scans_step0_prelude(kind: str) -> None:
    """``init_leaky()`` states: step 0 runs first and the extremum is carried as state."""
    x = _tie_input()

    def loop(m: nn.Module, x: Tensor) -> Tensor:
        fc1, lif1, fc2, lif2 = m
        mem1, mem2, mems = lif1.init_leaky(), lif2.init_leaky(), []
        for t in range(T):
            spk1, mem1 = lif1(fc1(x[t]), mem1)
            _, mem2 = lif2(fc2(spk1), mem2)
            mems.append(mem2)
        v = torch.stack(mems)
        return v.max(0).values if kind == "max" else v.min(0).values

    def route(m: nn.Module, x: Tensor) -> Tensor:
        fc1, lif1, fc2, lif2 = m

        def step(state: Any, x_t: Tensor) -> Any:
            spk1, mem1 = lif1(fc1(x_t), state[0])
            _, mem2 = lif2(fc2(spk1), state[1])
            return (mem1, mem2), mem2

        state = (lif1.init_leaky(), lif2.init_leaky())
        return sc.scan(step, x, state, plan=sc.plans.Uniform(3), readout=kind)[0]

    def build() -> nn.Module:
        return nn.Sequential(
            nn.Linear(6, 8), snn.Leaky(beta=0.9), nn.Linear(8, 5, bias=False),
            snn.Leaky(beta=0.9, reset_mechanism="none"),
        )  # fmt: skip

    check(build, loop, route, x, f"scan readout={kind} from init_leaky (ties)")


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_reducer_matches_max_dim0_with_ties_and_nans(kind: str, chunk: int) -> None:
    """The reducer's value, index and gradient against ``max(0)``'s (step by step and chunk by
    chunk), on data with ties, signed zeros and NaNs."""
    g = torch.Generator().manual_seed(5)
    ys = torch.randint(-2, 3, (16, 4, 9), generator=g).float()
    ys[3, 0, :4] = float("nan")
    ys[9, 1, 2:6] = float("nan")
    ys[:, 2, 0] = torch.tensor([0.0, -0.0] * 8)
    want = ys.max(0) if kind == "max" else ys.min(0)
    grad = torch.randn(4, 9, generator=g)
    leaf = ys.clone().requires_grad_()
    (want_grad,) = torch.autograd.grad(
        (leaf.max(0) if kind == "max" else leaf.min(0)).values, leaf, grad
    )
    for by_chunk in (False, True):
        r = Reducer(kind, 16)
        for t0 in range(0, 16, chunk):
            if by_chunk:
                r.emit_chunk(t0, [ys[t0 : t0 + chunk]])
            else:
                for t in range(t0, min(t0 + chunk, 16)):
                    r.emit(t, [ys[t]])
        (value,) = r.outputs()
        assert torch.equal(value.nan_to_num(7.0), want.values.nan_to_num(7.0))
        assert torch.equal(value.signbit(), want.values.signbit())
        assert torch.equal(r.index[0], want.indices)
        per_step = torch.stack([r.y_grad([grad])(t)[0] for t in range(16)])
        assert torch.equal(per_step, want_grad)
        chunks = torch.cat(
            [r.chunk_grad([grad], a, min(a + chunk, 16))[0] for a in range(0, 16, chunk)]
        )
        assert torch.equal(chunks, want_grad)


def test_the_docs_folds_against_the_plain_loop_with_ties() -> None:
    """docs/scan.md shows ``readout="max"`` and a leaky fold: both give the plain loop's
    gradient on data with ties; the old fold ``torch.maximum(acc, y)`` does not."""
    # a tie whose steps depend on w differently: v = 0 at step 0 (no input) and at step 1,
    # where two inputs cancel exactly (w[1] = -w[0]); below 0 afterwards (w[2] < 0)
    g = torch.Generator().manual_seed(0)
    w_data = torch.randn(6, 5, generator=g)
    w_data[1] = -w_data[0]
    w_data[2] = -w_data[2].abs() - 0.1
    w = torch.nn.Parameter(w_data)
    x = torch.zeros(T, B, 6)
    x[1, :, :2] = 1.0
    x[2:, :, 2] = 1.0

    def step(v: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor]:
        v = 0.9 * v + x_t @ w
        return v, v

    v0 = torch.zeros(B, 5)
    vs = []
    v = v0
    for t in range(T):
        v, y = step(v, x[t])
        vs.append(y)
    stacked = torch.stack(vs)
    assert torch.equal(stacked[0], stacked[1]) and torch.equal(stacked.max(0).values, stacked[0])
    plan = sc.plans.Uniform(3)
    fold_leaky: Any = lambda acc, y, t: y if acc is None else 0.9 * acc + y  # noqa: E731
    old_max: Any = lambda acc, y, t: y if acc is None else torch.maximum(acc, y)  # noqa: E731
    leaky = stacked[0]
    for t in range(1, T):
        leaky = 0.9 * leaky + stacked[t]
    cases = [
        ("max", stacked.max(0).values, True),
        (fold_leaky, leaky, True),
        (old_max, stacked.max(0).values, False),
    ]
    for readout, want, exact in cases:
        (want_g,) = torch.autograd.grad(want.sum(), w, retain_graph=True)
        got, _ = sc.scan(step, x, v0, plan=plan, readout=readout)
        (got_g,) = torch.autograd.grad(got.sum(), w)
        assert torch.equal(got, want)
        if exact:
            torch.testing.assert_close(got_g, want_g)
        else:  # the ties split the gradient: documented as not the loop's
            assert not torch.allclose(got_g, want_g)


# ----------------------------------------------------------------------------- 4. non-Parameters


class TensorBetaNeuron(nn.Module):
    """A hand-written neuron with a learnable decay that is a plain tensor, not a Parameter."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.beta = torch.full((n,), 0.8, requires_grad=True)

    def forward(self, x: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:
        mem = self.beta * mem + x
        spk = torch.sigmoid(4 * (mem - 1.0))
        return spk, mem - spk


_HIDDEN: dict[int, Tensor] = {}


class GlobalBetaNeuron(nn.Module):
    """The same with its decay kept in a global dict: nothing on the model points at it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        _HIDDEN[id(self)] = torch.full((n,), 0.8, requires_grad=True)

    @property
    def beta(self) -> Tensor:
        return _HIDDEN[id(self)]

    def forward(self, x: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:
        mem = _HIDDEN[id(self)] * mem + x
        spk = torch.sigmoid(4 * (mem - 1.0))
        return spk, mem - spk


def _tensor_beta_case(
    cls: type,
    route: Callable[[nn.Module, list[Tensor], Tensor], Tensor],
    granularity: str = "stack",
) -> tuple[float, float]:
    """Outputs bitwise the loop's for the stack granularity; layer-wise at round-off: it
    multiplies a chunk's inputs by the weight in one product, which some BLAS libraries sum in
    another order than the loop's per-step product (this VM's does not; the CPU of the H200
    machine did, with one thread too: 3 cases 1 ulp off there)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), cls(8), nn.Linear(8, 4), cls(4))
    betas = [net[1].beta, net[3].beta]
    x = torch.rand(T, B, 6)
    mems = [torch.zeros(B, 8), torch.zeros(B, 4)]
    outs = []
    for t in range(T):
        s, mems[0] = net[1](net[0](x[t]), mems[0])
        s, mems[1] = net[3](net[2](s), mems[1])
        outs.append(s)
    ref = torch.stack(outs)
    wrt = [*betas, *net.parameters()]
    want = torch.autograd.grad(_loss(ref), wrt)
    got_y = route(net, betas, x)
    got = torch.autograd.grad(_loss(got_y), wrt)
    if granularity == "stack":
        assert torch.equal(got_y, ref)
    else:
        torch.testing.assert_close(got_y, ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    return 0.0, max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_tensor_attributes_get_their_gradient(plan: Any, granularity: str) -> None:
    diff = _tensor_beta_case(
        TensorBetaNeuron,
        lambda m, b, x: sc.wrap(m, plan=plan, granularity=granularity)(x),
        granularity,
    )
    MEASURED[f"non-Parameter beta {granularity}"] = diff


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_unfound_tensor_is_refused_naming_the_layer_and_wrap_params_fixes_it(
    granularity: str,
) -> None:
    plan = sc.plans.Uniform(3)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), GlobalBetaNeuron(8), nn.Linear(8, 4), GlobalBetaNeuron(4))
    x = torch.rand(T, B, 6)
    where = r"layers '1', '3'" if granularity == "stack" else r"neuron is layer '3'"
    with pytest.raises(UnlistedParamsError, match=rf"{where}.*wrap\(model, \.\.\., params="):
        sc.wrap(net, plan=plan, granularity=granularity)(x).sum().backward()
    diff = _tensor_beta_case(
        GlobalBetaNeuron,
        lambda m, b, x: sc.wrap(m, plan=plan, granularity=granularity, params=b)(x),
        granularity,
    )
    MEASURED[f"wrap(params=...) {granularity}"] = diff


def test_scan_refuses_an_unfound_tensor_and_takes_it_in_params() -> None:
    holder = type("Holder", (), {})()
    holder.w = torch.randn(5, 5, requires_grad=True)

    def hidden(v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        v = torch.tanh(v @ holder.w + x)
        return v, v

    x, v0 = torch.randn(T, B, 5), torch.zeros(B, 5)
    with pytest.raises(UnlistedParamsError, match=r"\(5, 5\).*params="):
        sc.scan(hidden, x, v0, plan=sc.plans.Uniform(3))
    ys, _ = sc.scan(hidden, x, v0, plan=sc.plans.Uniform(3), params=[holder.w])
    assert torch.autograd.grad(ys.sum(), holder.w)[0].abs().sum() > 0
    with pytest.raises(TypeError, match="params must be a list of tensors"):
        sc.wrap(nn.Sequential(nn.Linear(5, 5), snn.Leaky(0.9)), params=holder.w)


# ----------------------------------------------------------------------------- 5. call sites


def _last(kind: str) -> nn.Module:
    return {
        "Leaky": lambda: snn.Leaky(beta=0.9, init_hidden=True, output=True),
        "Synaptic": lambda: snn.Synaptic(alpha=0.8, beta=0.9, init_hidden=True, output=True),
        "Alpha": lambda: snn.Alpha(alpha=0.9, beta=0.8, init_hidden=True, output=True),
        "RLeaky": lambda: snn.RLeaky(beta=0.9, linear_features=4, init_hidden=True, output=True),
        "DeltaLeaky": lambda: snn.DeltaLeaky(beta=0.9, init_hidden=True),
    }[kind]()


@pytest.mark.parametrize("kind", ["Leaky", "Synaptic", "Alpha", "RLeaky", "DeltaLeaky"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_output_true_returns_what_the_call_returned(kind: str, granularity: str) -> None:
    x = _spikes((T, B, 6))

    def build() -> nn.Module:
        return nn.Sequential(
            nn.Linear(6, 8), snn.Leaky(beta=0.9, init_hidden=True), nn.Linear(8, 4), _last(kind)
        )

    def loop(m: nn.Module, x: Tensor) -> Any:  # DeltaLeaky: snnTorch's reset fails on it
        outs = [m(x[t]) for t in range(T)]
        return pytree.tree_map(lambda *ys: torch.stack(ys), *outs)

    def route(m: nn.Module, x: Tensor) -> Any:
        got = sc.wrap(m, plan=sc.plans.Uniform(3), granularity=granularity)(x)
        want = loop(copy.deepcopy(build()), x)
        assert pytree.tree_structure(got) == pytree.tree_structure(want)
        return got

    check(build, loop, route, x, f"output=True {kind} {granularity}")


def test_output_true_unpacks_at_t2_and_explicit_output_still_wins() -> None:
    """``spk, mem = seq(x)`` used to unpack the time axis silently at T=2."""
    net = nn.Sequential(nn.Linear(6, 4), _last("Leaky"))
    x = _spikes((2, B, 6))
    spk, mem = sc.wrap(net, plan=sc.plans.Uniform(1))(x)
    assert spk.shape == mem.shape == (2, B, 4)
    assert sc.wrap(net, plan=sc.plans.Uniform(1), output="spikes")(x).shape == (2, B, 4)
    counts, mem_sum = sc.wrap(net, plan=sc.plans.Uniform(1), readout="sum")(x)
    assert torch.equal(counts, spk.sum(0)) and torch.equal(mem_sum, mem[0] + mem[1])


def test_the_own_loop_error_shows_the_constant_input_route() -> None:
    from test_zoo import FCN

    with pytest.raises(UnsupportedLayerError, match=r"(?s)same x \(B, \.\.\.\).*steps="):
        sc.wrap(FCN())


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_scan_steps_feeds_the_same_input_at_every_step(plan: Any) -> None:
    """Tutorial 5's static image, pasted as the error message shows it; the image's own
    gradient too."""
    from test_zoo import FCN

    torch.manual_seed(0)
    net = FCN()
    x = torch.rand(B, 6, requires_grad=True)
    spk, mem = net(x)
    wrt = [x, *net.parameters()]
    want = torch.autograd.grad(_loss((spk, mem)), wrt)

    def step(state: Any, x_t: Tensor) -> Any:
        mem1, mem2 = state
        spk1, mem1 = net.lif1(net.fc1(x_t), mem1)
        spk2, mem2 = net.lif2(net.fc2(spk1), mem2)
        return (mem1, mem2), (spk2, mem2)

    state = (net.lif1.init_leaky(), net.lif2.init_leaky())
    (spk2, mem2), _ = sc.scan(step, x, state, steps=T, plan=plan)
    got = torch.autograd.grad(_loss((spk2, mem2)), wrt)
    assert torch.equal(spk2, spk) and torch.equal(mem2, mem)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    MEASURED["scan steps= (tutorial 5)"] = (
        0.0,
        max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)),
    )


def test_scan_steps_refuses_bad_values() -> None:
    def step(v: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor]:
        return v + x_t, v

    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="steps must be a positive int"):
            sc.scan(step, torch.zeros(2, 3), torch.zeros(2, 3), steps=bad, plan=sc.plans.BPTT())
