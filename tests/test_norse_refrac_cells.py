"""Norse's refractory cells beyond ``LIFRefracCell``, fused in the layer-wise granularity:
``LIFAdExRefracCell`` (`NorseAdExRefracKernel`), ``LIFRefracRecurrentCell`` and
``LIFAdExRefracRecurrentCell`` (`NorseRefracRecurrentKernel`), each in
``SequentialState(Linear, cell, Linear, LICell)`` against Norse's own loop: outputs bitwise,
gradients (the input, both ``Linear``'s, the cell's weights) at float32 round-off; a
refractory period across chunk boundaries with the gradients to the initial state; a
float64 model within 1e-12; a learnable parameter field keeps the per-step call."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from norse_cells import check_learnable_field, close, counted_gathers, norse_loop
from torch import Tensor, nn

import spikeckpt as sc

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse
    from norse.torch.functional.lif import LIFState
    from norse.torch.functional.lif_adex import LIFAdExFeedForwardState, LIFAdExState
    from norse.torch.functional.lif_adex_refrac import (
        LIFAdExRefracFeedForwardState,
        LIFAdExRefracState,
    )
    from norse.torch.functional.lif_refrac import LIFRefracState
    from norse.torch.module.sequential import SequentialState


def _adex(**fields: Any) -> Any:
    return norse.LIFAdExRefracParameters(
        norse.LIFAdExParameters(**fields.pop("adex", {})), **fields
    )


#: ``(n_in, hidden) -> cell``: the cells, default and other parameters (another surrogate,
#: per-neuron fields, a fractional refractory period, autapses)
CELLS: dict[str, Callable[[int, int], nn.Module]] = {
    "adex": lambda n, h: norse.LIFAdExRefracCell(),
    "adex triangle adapting": lambda n, h: norse.LIFAdExRefracCell(
        _adex(
            adex={
                "method": "triangle",
                "adaptation_current": torch.tensor(20.0),
                "adaptation_spike": torch.linspace(0.5, 3.0, h),
                "tau_ada_inv": torch.tensor(50.0),
                "v_reset": torch.tensor(-0.2),
            },
            rho_reset=torch.linspace(0.5, 3.5, h),
        )
    ),
    "lif recurrent": lambda n, h: norse.LIFRefracRecurrentCell(n, h),
    "lif recurrent triangle autapses": lambda n, h: norse.LIFRefracRecurrentCell(
        n,
        h,
        p=norse.LIFRefracParameters(
            norse.LIFParameters(method="triangle", v_reset=torch.linspace(-0.2, 0.1, h)),
            rho_reset=torch.linspace(0.5, 3.5, h),
        ),
        autapses=True,
    ),
    "adex recurrent": lambda n, h: norse.LIFAdExRefracRecurrentCell(n, h),
    "adex recurrent triangle adapting": lambda n, h: norse.LIFAdExRefracRecurrentCell(
        n,
        h,
        p=_adex(
            adex={
                "method": "triangle",
                "adaptation_spike": torch.linspace(0.5, 3.0, h),
                "tau_ada_inv": torch.tensor(50.0),
            },
            rho_reset=torch.tensor(2.5),
        ),
        autapses=True,
    ),
}


def _net(name: str, seed: int, n_in: int = 4, hidden: int = 6) -> nn.Module:
    """``SequentialState(Linear, cell, Linear, LICell)``, weights that make the cell fire
    often (and fire back)."""
    torch.manual_seed(seed)
    cell = CELLS[name](hidden, hidden)
    net = SequentialState(nn.Linear(n_in, hidden), cell, nn.Linear(hidden, 3), norse.LICell())
    with torch.no_grad():
        net[0].weight.mul_(8.0)
        if hasattr(cell, "recurrent_weights"):
            cell.input_weights.mul_(4.0)
            cell.recurrent_weights.mul_(2.0)
    return net


def _input(T: int, batch: int, seed: int) -> Tensor:
    torch.manual_seed(seed)
    return ((torch.rand(T, batch, 4) < 0.5).float() * 2.0).requires_grad_()


def _check(name: str, T: int, chunk: int, batch: int, seed: int) -> None:
    """The wrapped model against Norse's loop: outputs bitwise, gradients at round-off, the
    cell's block fused for every chunk."""
    net = _net(name, seed)
    x = _input(T, batch, seed)
    params = list(net.parameters())
    want = norse_loop(net, x)
    g_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x, *params], g_out)
    seq = sc.wrap(
        net, granularity="layer", chunk=chunk, exact=True
    )  # bitwise: products step by step (a chunk's rounds otherwise on some BLAS kernels)
    got, _ = seq(x)
    assert seq.last_stats.blocks[0].neuron_chunks == {"fused": math.ceil(T / chunk)}
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad(got, [x, *params], g_out)
    for a, b in zip(want_grads, got_grads, strict=True):
        close(a, b)


def _cell_run(name: str, seed: int) -> tuple[Tensor, Tensor]:
    """The cell's own spikes and refractory counters over 13 steps (the net of `_check`)."""
    net = _net(name, seed)
    x = _input(13, 3, seed)
    spikes, counters, state = [], [], None
    with torch.no_grad():
        for x_t in x:
            z, state = net[1](net[0](x_t), state)
            spikes.append(z)
            counters.append(state.rho)
    return torch.stack(spikes), torch.stack(counters)


@pytest.mark.parametrize("name", sorted(CELLS))
def test_the_cells_of_the_checks_fire_and_hold(name: str) -> None:
    """The nets of these tests spike, and their neurons sit refractory at chunk boundaries
    (a silent or never-refractory cell would pass any comparison of spikes)."""
    spikes, counters = _cell_run(name, 0)
    assert spikes.sum() > 5
    assert (counters[3::4] > 0).sum() > 3  # refractory at the last step of a chunk of 4


@pytest.mark.parametrize("name", sorted(CELLS))
def test_refractory_cells_match_norses_loop(name: str) -> None:
    """Each cell, 13 steps in chunks of 4 (a short last chunk)."""
    _check(name, 13, 4, 3, 0)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(CELLS)),
    T=st.integers(0, 7).map(lambda n: 2 * n + 1),
    chunk=st.integers(1, 16),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_refractory_cells_over_chunk_lengths(
    name: str, T: int, chunk: int, batch: int, seed: int
) -> None:
    """Odd T, any chunk (longer than T too, or T=1): outputs bitwise Norse's loop,
    gradients at round-off."""
    _check(name, T, chunk, batch, seed)


def _start(
    name: str, batch: int, hidden: int, dtype: torch.dtype = torch.float32
) -> tuple[Any, list[Tensor]]:
    """An initial state partly refractory (``rho`` from 0 to 5.5, some fractional), the
    membranes spread below the threshold; and its leaves taking gradients (all but the
    recurrent cells' spikes)."""
    n = batch * hidden

    def spread(lo: float, hi: float) -> Tensor:
        return torch.linspace(lo, hi, n, dtype=dtype).reshape(batch, hidden).requires_grad_()

    v, i, a = spread(0.0, 0.95), spread(-1.0, 2.0), spread(-0.5, 0.5)
    counts = torch.arange(float(n), dtype=dtype).reshape(batch, hidden)
    rho = (counts % 12 / 2).requires_grad_()
    z = (counts % 3 == 0).to(dtype)
    if name == "adex":
        return LIFAdExRefracFeedForwardState(LIFAdExFeedForwardState(v, i, a), rho), [v, i, a, rho]
    if name == "lif recurrent":
        return LIFRefracState(LIFState(z, v, i), rho), [v, i, rho]
    return LIFAdExRefracState(LIFAdExState(z, v, i, a), rho), [v, i, a, rho]


def _chunked(linear: nn.Module, x: Tensor, chunk: int) -> list[Tensor]:
    """``linear``'s output per step computed as the engine computes it, one call per chunk
    (a recurrent cell's input product on a step of another ``Linear`` call may round
    otherwise: the membranes would differ at round-off, the spikes not)."""
    steps: list[Tensor] = []
    for t0 in range(0, x.shape[0], chunk):
        xc = x[t0 : t0 + chunk]
        steps += linear(xc.reshape(-1, xc.shape[-1])).reshape(*xc.shape[:2], -1).unbind(0)
    return steps


@pytest.mark.parametrize("name", ["adex", "lif recurrent", "adex recurrent"])
def test_a_refractory_period_across_chunk_boundaries_matches_norses_loop(name: str) -> None:
    """An initial state already refractory, chunks of 3: the counter and the mask carried
    from one chunk to the next. The fused run gives Norse's loop's spikes and membranes
    bitwise, its final state bitwise, and the gradients (input, weights, every leaf of the
    initial state: the mask's surrogate through ``rho``) at round-off."""
    net = _net(name, 4)
    cell = net[1]
    x = _input(14, 3, 4)
    start, leaves = _start(name, 3, 6)
    spikes, mems, rhos, s = [], [], [], start
    for h_t in _chunked(net[0], x, 3):
        z, s = cell(h_t, s)
        spikes.append(z)
        mems.append(s[0].v)
        rhos.append(s.rho)
    counters = torch.stack(rhos)
    assert (counters[2::3] > 1).sum() > 5  # refractory across a chunk's end
    want = [torch.stack(spikes), torch.stack(mems), *s[0], s.rho]
    wrt = [x, *net[0].parameters(), *cell.parameters(), *leaves]
    weights = [torch.linspace(-1, 1, t.numel()).view_as(t) for t in want]

    def loss(outs: list[Tensor]) -> Tensor:
        return sum((t * w).sum() for t, w in zip(outs, weights, strict=True))  # type: ignore[return-value]

    want_grads = torch.autograd.grad(loss(want), wrt)
    seq = sc.wrap(nn.Sequential(net[0], cell), granularity="layer", chunk=3, output="both")
    (got_spikes, got_v), final = seq(x, state=[None, start], return_state=True)
    assert seq.last_stats.blocks[0].neuron == "fused"
    got = [got_spikes, got_v, *final[1][0], final[1].rho]
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    got_grads = torch.autograd.grad(loss(got), wrt)
    for a, b in zip(want_grads, got_grads, strict=True):
        assert a.abs().sum() > 0
        close(a, b)


@pytest.mark.parametrize("name", ["adex", "lif recurrent", "adex recurrent"])
def test_a_float64_model_runs_fused_at_float64_round_off(name: str) -> None:
    """``model.double()`` (Norse's float32 0-d parameters beside float64 states) from a
    float64 initial state (Norse's own starts ``v`` as a float32 0-d ``v_leak``, and its
    first step's exponential rounds in float32): fused, the outputs bitwise Norse's loop's,
    every gradient, the initial state's too, within 1e-12: the kernels' backward is exact,
    not merely close."""
    net = _net(name, 6).double()
    cell = net[1]
    x = _input(11, 3, 6).detach().double().requires_grad_()
    start, leaves = _start(name, 3, 6, torch.float64)
    wrt = [x, *net[0].parameters(), *cell.parameters(), *leaves]
    spikes, s = [], start
    for h_t in _chunked(net[0], x, 4):
        z, s = cell(h_t, s)
        spikes.append(z)
    want = torch.stack(spikes)
    g_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, wrt, g_out)
    seq = sc.wrap(nn.Sequential(net[0], cell), granularity="layer", chunk=4)
    got = seq(x, state=[None, start])
    assert seq.last_stats.blocks[0].neuron == "fused"
    assert got.dtype == torch.float64 and torch.equal(got, want)
    for a, b in zip(want_grads, torch.autograd.grad(got, wrt, g_out), strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12 * float(a.abs().max()))


def _learnable(name: str, field: Tensor) -> nn.Module:
    """A cell with ``field`` its threshold: ``p.lif_adex.v_th`` or ``p.lif.v_th``."""
    if name == "lif recurrent":
        return norse.LIFRefracRecurrentCell(
            6, 6, p=norse.LIFRefracParameters(norse.LIFParameters(v_th=field))
        )
    if name == "adex recurrent":
        return norse.LIFAdExRefracRecurrentCell(6, 6, p=_adex(adex={"v_th": field}))
    return norse.LIFAdExRefracCell(_adex(adex={"v_th": field}))


@pytest.mark.parametrize("name", ["adex", "lif recurrent", "adex recurrent"])
def test_a_learnable_parameter_field_keeps_the_per_step_call(name: str) -> None:
    """The kernels take no gradient for the parameters' fields: a cell with a learnable one
    (an ``nn.Parameter`` in its NamedTuple) runs per step layer-wise, and every gradient, the
    field's too, is Norse's loop's at round-off; the same cell with the field fixed runs
    fused."""
    torch.manual_seed(2)
    field = nn.Parameter(torch.full((6,), 1.0))
    net = SequentialState(nn.Linear(4, 6), _learnable(name, field))
    with torch.no_grad():
        net[0].weight.mul_(8.0)
    x = (torch.rand(10, 2, 4) < 0.5).float() * 2
    want = norse_loop(net, x)
    assert want.sum() > 0
    check_learnable_field(net, x, field, want)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    adaptive=st.booleans(),
    T=st.integers(0, 6).map(lambda n: 2 * n + 1),
    B=st.integers(1, 3),
    chunk=st.integers(1, 8),
    exact=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_recurrent_refractory_cell_first_gathers_its_sparse_input(
    adaptive: bool, T: int, B: int, chunk: int, exact: bool, seed: int
) -> None:
    """``LIFRefracRecurrentCell`` / ``LIFAdExRefracRecurrentCell`` weighting a sparse spike
    input itself: its kernel sums ``x W_in^T`` over the chunk's non-zeros (one gather per
    chunk) and ``W_in``'s gradient over them, unless ``exact=True`` (the cell's own product
    per step). Weights on a 1/4 grid, so every sum is exact in any order: the cell's spikes
    bitwise Norse's loop either way, the output and gradients within round-off."""

    torch.manual_seed(seed)
    n_in, hidden = 64, 48
    make = norse.LIFAdExRefracRecurrentCell if adaptive else norse.LIFRefracRecurrentCell
    cell = make(n_in, hidden)
    net = SequentialState(cell, nn.Linear(hidden, 3), norse.LICell())
    with torch.no_grad():
        cell.input_weights.copy_(torch.randint(-8, 48, cell.input_weights.shape) / 4)
        cell.recurrent_weights.copy_(torch.randint(-8, 9, cell.recurrent_weights.shape) / 4)
    x = (torch.rand(T, B, n_in) < 0.04).float()
    params = list(net.parameters())
    want = norse_loop(net, x)
    want_grads = torch.autograd.grad(want.sum(), params)
    with counted_gathers() as calls:
        seq = sc.wrap(net, granularity="layer", chunk=chunk, exact=exact)
        got = seq(x)[0]
        got_grads = torch.autograd.grad(got.sum(), params)
        alone = sc.wrap(SequentialState(cell), granularity="layer", chunk=chunk, exact=exact)
        got_spikes = alone(x)[0]
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    # the tests' gather rule (conftest): a chunk of at most 1/16 ones gathers
    sparse = any(bool(c.count_nonzero() <= c.numel() / 16) for c in x.split(chunk))
    assert bool(calls) == (not exact and sparse)
    with torch.no_grad():
        assert torch.equal(got_spikes, norse_loop(cell, x))
    close(want, got)  # LICell's membrane: the Linear before it one product per chunk
    for a, b in zip(want_grads, got_grads, strict=True):
        close(a, b)
