"""Norse's recurrent cells fused in the layer-wise granularity beyond ``LIFRecurrentCell``
and ``LSNNRecurrentCell``: ``LIFExRecurrentCell`` and ``LIFAdExRecurrentCell``
(`NorseExRecurrentKernel`), each against Norse's own loop: outputs bitwise, gradients (input,
the first ``Linear``'s, the cell's input and recurrent weights) at float32 round-off."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from norse_cells import close, norse_loop
from torch import Tensor, nn

import spikeckpt as sc

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse
    from norse.torch.module.sequential import SequentialState

#: ``(n_in, hidden, autapses) -> cell``
CELLS: dict[str, Callable[[int, int, bool], nn.Module]] = {
    "lifex": lambda n, h, aut: norse.LIFExRecurrentCell(n, h, autapses=aut),
    "lifex tanh sharp": lambda n, h, aut: norse.LIFExRecurrentCell(
        n,
        h,
        p=norse.LIFExParameters(
            method="tanh",
            delta_T=torch.full((h,), 0.2),
            v_th=torch.tensor(0.6),
            v_reset=torch.tensor(-0.1),
        ),
        autapses=aut,
    ),
    "lifadex": lambda n, h, aut: norse.LIFAdExRecurrentCell(n, h, autapses=aut),
    "lifadex triangle adapting": lambda n, h, aut: norse.LIFAdExRecurrentCell(
        n,
        h,
        p=norse.LIFAdExParameters(
            method="triangle",
            adaptation_current=torch.tensor(20.0),
            adaptation_spike=torch.linspace(0.5, 3.0, h),
            tau_ada_inv=torch.tensor(50.0),
            delta_T=torch.tensor(1.5),
            v_reset=torch.tensor(-0.2),
        ),
        autapses=aut,
    ),
}


def _net(name: str, n_in: int, hidden: int, autapses: bool, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    cell = CELLS[name](hidden, hidden, autapses)
    with torch.no_grad():  # weights that make the cell fire often, and fire back
        cell.input_weights.mul_(4.0)
        cell.recurrent_weights.mul_(2.0)
    return SequentialState(nn.Linear(n_in, hidden), cell, nn.Linear(hidden, 3), norse.LICell())


def _check(name: str, T: int, chunk: int, batch: int, autapses: bool, seed: int) -> None:
    """The wrapped model against Norse's loop: outputs bitwise, gradients at round-off, the
    cell's block fused."""
    n_in, hidden = 4, 6
    net = _net(name, n_in, hidden, autapses, seed)
    x = ((torch.rand(T, batch, n_in) < 0.5).float() * 2.0).requires_grad_()
    params = list(net.parameters())
    want = norse_loop(net, x)
    g_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x, *params], g_out)
    seq = sc.wrap(
        net, granularity="layer", chunk=chunk, exact=True
    )  # bitwise: products step by step (a chunk's rounds otherwise on some BLAS kernels)
    got, _ = seq(x)
    assert seq.last_stats.blocks[0].neuron == "fused"
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad(got, [x, *params], g_out)
    for a, b in zip(want_grads, got_grads, strict=True):
        close(a, b)


@pytest.mark.parametrize("autapses", [False, True], ids=["no autapses", "autapses"])
@pytest.mark.parametrize("name", sorted(CELLS))
def test_recurrent_exponential_cells_match_norses_loop(name: str, autapses: bool) -> None:
    """Each cell, autapses on and off, 11 steps in chunks of 4 (a short last chunk)."""
    _check(name, 11, 4, 3, autapses, 0)


def _spikes(name: str, seed: int) -> Tensor:
    """The cell's own spikes over 11 steps (the net of `_check`)."""
    net = _net(name, 4, 6, False, seed)
    torch.manual_seed(seed)
    x = (torch.rand(11, 3, 4) < 0.5).float() * 2.0
    out, state = [], None
    for x_t in x:
        z, state = net[1](net[0](x_t), state)
        out.append(z)
    return torch.stack(out)


@pytest.mark.parametrize("name", sorted(CELLS))
def test_the_cells_of_the_checks_fire(name: str) -> None:
    """The nets of these tests spike (a silent cell would pass any comparison of spikes)."""
    assert _spikes(name, 0).sum() > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(CELLS)),
    T=st.integers(1, 13),
    chunk=st.integers(1, 6),
    batch=st.integers(1, 3),
    autapses=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_recurrent_exponential_cells_over_chunk_lengths(
    name: str, T: int, chunk: int, batch: int, autapses: bool, seed: int
) -> None:
    """Any chunk length, T not a multiple of it, T=1: outputs bitwise Norse's loop, gradients
    at round-off."""
    _check(name, T, chunk, batch, autapses, seed)


def test_a_learnable_field_keeps_the_per_step_call() -> None:
    """A field of the parameters that takes a gradient: the kernel declines it (it returns no
    field gradients), the cell steps per call, its field's gradient Norse's own."""
    torch.manual_seed(0)
    p = norse.LIFAdExParameters(tau_ada_inv=nn.Parameter(torch.tensor(50.0)))
    net = SequentialState(nn.Linear(4, 5), norse.LIFAdExRecurrentCell(5, 5, p=p))
    x = (torch.rand(7, 2, 4) < 0.5).float()
    want = norse_loop(net, x)
    (want_grad,) = torch.autograd.grad(want.sum(), [p.tau_ada_inv])
    seq = sc.wrap(net, granularity="layer", chunk=3)
    got, _ = seq(x)
    assert seq.last_stats.blocks[0].neuron == "per-step"
    assert torch.equal(got, want)
    (got_grad,) = torch.autograd.grad(got.sum(), [p.tau_ada_inv])
    close(want_grad, got_grad)
