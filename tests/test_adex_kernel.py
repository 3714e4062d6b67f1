"""Norse's ``LIFExCell`` and ``LIFAdExCell`` fused (`NorseExKernel`), beyond the table of
``test_fused.py``: in Norse's own containers, with a learnable parameter (the per-step call),
and where the exponential overflows (Norse's NaNs, at the same places)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from norse_cells import check_learnable_field, close, norse_loop
from torch import Tensor, nn

import spikeckpt as sc

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse
    from norse.torch.functional.lif_adex import LIFAdExFeedForwardState
    from norse.torch.functional.lif_ex import LIFExFeedForwardState

CELLS: dict[str, Callable[[], nn.Module]] = {
    "LIFExCell": lambda: norse.LIFExCell(),
    "LIFAdExCell": lambda: norse.LIFAdExCell(
        norse.LIFAdExParameters(adaptation_current=torch.tensor(10.0), tau_ada_inv=20.0)
    ),
}


@pytest.mark.parametrize("name", sorted(CELLS))
def test_a_sequential_state_of_exponential_cells_runs_fused_as_norses_loop(name: str) -> None:
    """``SequentialState(Linear, cell, Linear, cell)`` layer-wise (T = 13, chunks of 4: the
    last one short): both cells fused, the output spikes bitwise Norse's loop's, the loss's
    gradients (both weights, the input) at round-off."""
    torch.manual_seed(0)
    model = norse.SequentialState(nn.Linear(4, 8), CELLS[name](), nn.Linear(8, 3), CELLS[name]())
    with torch.no_grad():
        model[0].weight.mul_(4.0)
        model[2].weight.mul_(6.0)
    x = ((torch.rand(13, 2, 4) < 0.5).float() * 2).requires_grad_()
    wrt = [x, *model.parameters()]
    want = norse_loop(model, x)
    assert want.sum() > 0
    want_grads = torch.autograd.grad(
        (want * torch.linspace(-1, 1, want.numel()).view_as(want)).sum(), wrt
    )
    seq = sc.wrap(model, granularity="layer", chunk=4)
    got, _ = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad(
        (got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum(), wrt
    )
    for a, b in zip(want_grads, got_grads, strict=True):
        assert a.abs().sum() > 0
        close(a, b)


@pytest.mark.parametrize("module", ["LIFEx", "LIFAdEx"])
def test_the_sequence_modules_run_fused_as_norses_loop(module: str) -> None:
    """Norse's sequence modules ``LIFEx`` and ``LIFAdEx`` (the same steps, looped over time by
    Norse) in ``SequentialState(Lift(Linear), module)``: fused layer-wise, the spikes
    bitwise and the gradients at round-off of Norse's own call on the whole sequence."""
    torch.manual_seed(1)
    model = norse.SequentialState(norse.Lift(nn.Linear(4, 6)), getattr(norse, module)())
    with torch.no_grad():
        model[0].lifted_module.weight.mul_(5.0)
    x = ((torch.rand(11, 3, 4) < 0.5).float() * 2).requires_grad_()
    want, _ = model(x)
    assert want.sum() > 0
    w = torch.linspace(-1, 1, want.numel()).view_as(want)
    want_grads = torch.autograd.grad((want * w).sum(), [x, *model.parameters()])
    seq = sc.wrap(model, granularity="layer", chunk=3)
    got, _ = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad((got * w).sum(), [x, *model.parameters()])
    for a, b in zip(want_grads, got_grads, strict=True):
        close(a, b)


@pytest.mark.parametrize(
    "make",
    [
        lambda tau: norse.LIFExCell(norse.LIFExParameters(delta_T=tau)),
        lambda tau: norse.LIFAdExCell(norse.LIFAdExParameters(adaptation_current=tau)),
    ],
    ids=["LIFExCell delta_T", "LIFAdExCell adaptation_current"],
)
def test_a_learnable_parameter_field_keeps_the_per_step_call(
    make: Callable[[Tensor], nn.Module],
) -> None:
    """The kernel takes no gradient for the parameters' fields: a cell with a learnable one
    (an ``nn.Parameter`` in its NamedTuple) runs per step layer-wise, and every gradient, the
    field's too, is Norse's loop's at round-off; the same cell with the field fixed runs
    fused."""
    torch.manual_seed(2)
    field = nn.Parameter(torch.full((6,), 2.0))
    net = nn.Sequential(nn.Linear(4, 6), make(field))
    with torch.no_grad():
        net[0].weight.mul_(4.0)
    x = (torch.rand(10, 2, 4) < 0.5).float() * 2
    want = norse_loop(lambda x_t, s: net[1](net[0](x_t), s), x)  # type: ignore[arg-type]
    check_learnable_field(net, x, field, want)


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal, NaN where NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("adaptive", [False, True], ids=["LIFExCell", "LIFAdExCell"])
def test_where_the_exponential_overflows_the_kernel_gives_norses_nans(adaptive: bool) -> None:
    """Membranes starting high (30 to 60, ``delta_T = 0.5``: ``exp((v - v_th) / delta_T)`` from
    1e25 to inf) and a huge input (3e38: the current overflows): Norse's reset makes ``0 * inf
    = nan``, which spreads. The fused run gives the same spikes, membranes and final state,
    NaN at the same places, and gradients (input, weight, initial membrane) with NaN at the
    same places (the weight's everywhere) and the rest at round-off."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 6), norse.LIFAdExCell() if adaptive else norse.LIFExCell())
    with torch.no_grad():
        net[0].weight[:, 0] = 3e38  # the first input channel overflows the current
        net[0].weight[:, 1:].mul_(3.0)
    x = (torch.rand(9, 3, 4) < 0.5).float()
    x[:, 0, 0] = 0.0  # the first sample: only the high start
    x = x.requires_grad_()
    v0 = torch.linspace(30, 60, 18).reshape(3, 6).requires_grad_()
    zeros = torch.zeros(3, 6)
    start = (
        LIFAdExFeedForwardState(v0, zeros, zeros) if adaptive else LIFExFeedForwardState(v0, zeros)
    )

    def outputs(spikes: Tensor, state: Any) -> Tensor:
        return torch.cat([spikes.flatten(), *(t.flatten() for t in state)])

    states, spikes, s = [], [], start
    for x_t in x:
        z, s = net[1](net[0](x_t), s)
        spikes.append(z)
        states.append(s.v)
    want = torch.cat([outputs(torch.stack(spikes), s), torch.stack(states).flatten()])
    assert want.isnan().any() and not want.isnan().all()
    w = torch.linspace(-1, 1, want.numel())
    wrt = [x, net[0].weight, v0]
    want_grads = torch.autograd.grad((want.nan_to_num(0.0) * w).sum(), wrt)
    seq = sc.wrap(net, granularity="layer", chunk=4, output="both")
    (got_spikes, got_v), final = seq(x, state=[None, start], return_state=True)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    got = torch.cat([outputs(got_spikes, final[1]), got_v.flatten()])
    assert _same(got, want)
    got_grads = torch.autograd.grad((got.nan_to_num(0.0) * w).sum(), wrt)
    assert not want_grads[0].isnan().all()  # the weight's: NaN all over
    for a, b in zip(want_grads, got_grads, strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        finite = ~a.isnan()
        close(a[finite], b[finite])
