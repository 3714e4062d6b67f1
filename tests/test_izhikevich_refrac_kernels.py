"""Norse's ``IzhikevichCell`` / ``Izhikevich`` (`NorseIzhikevichKernel`) and ``LIFRefracCell``
(`NorseRefracKernel`) fused, beyond the table of ``test_fused.py``: in Norse's own containers,
with a learnable parameter (the per-step call), a refractory period across chunk boundaries
(the counter and the mask carried from one chunk to the next, gradients to the initial
counter), and a cell whose step changed since it was wrapped. Norse has no feed-forward
sequence module for ``LIFRefracCell`` (only ``LIFRefracRecurrent``)."""

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
    from norse.torch.functional.lif import LIFFeedForwardState
    from norse.torch.functional.lif_refrac import LIFRefracFeedForwardState

#: the cells, and the gains of the two Linears before them that make both layers fire
CELLS: dict[str, tuple[Callable[[], nn.Module], tuple[float, float]]] = {
    "IzhikevichCell": (lambda: norse.IzhikevichCell(norse.tonic_spiking), (300.0, 600.0)),
    "IzhikevichCell tonic_bursting": (
        lambda: norse.IzhikevichCell(norse.tonic_bursting),
        (300.0, 600.0),
    ),
    "LIFRefracCell": (lambda: norse.LIFRefracCell(), (15.0, 30.0)),
}


@pytest.mark.parametrize("name", sorted(CELLS))
def test_a_sequential_state_of_the_cells_runs_fused_as_norses_loop(name: str) -> None:
    """``SequentialState(Linear, cell, Linear, cell)`` layer-wise (T = 13, chunks of 4: the
    last one short): both cells fused, the output spikes bitwise Norse's loop's, the loss's
    gradients (both weights and biases, the input) at round-off."""
    torch.manual_seed(0)
    make, (g0, g1) = CELLS[name]
    model = norse.SequentialState(nn.Linear(4, 8), make(), nn.Linear(8, 3), make())
    with torch.no_grad():
        model[0].weight.mul_(g0)
        model[2].weight.mul_(g1)
    x = ((torch.rand(13, 2, 4) < 0.5).float() * 2).requires_grad_()
    wrt = [x, *model.parameters()]
    want = norse_loop(model, x)
    assert want.sum() > 0
    w = torch.linspace(-1, 1, want.numel()).view_as(want)
    want_grads = torch.autograd.grad((want * w).sum(), wrt)
    seq = sc.wrap(
        model, granularity="layer", chunk=4, exact=True
    )  # bitwise: products step by step (a chunk's rounds otherwise on some BLAS kernels)
    got, _ = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad((got * w).sum(), wrt)
    for a, b in zip(want_grads, got_grads, strict=True):
        assert a.abs().sum() > 0
        close(a, b)


def test_the_sequence_module_izhikevich_runs_fused_as_norses_loop() -> None:
    """Norse's sequence module ``Izhikevich`` (the same step, looped over time by Norse) in
    ``SequentialState(Lift(Linear), Izhikevich)``: fused layer-wise, the spikes bitwise and
    the gradients at round-off of Norse's own call on the whole sequence."""
    torch.manual_seed(1)
    model = norse.SequentialState(
        norse.Lift(nn.Linear(4, 6)), norse.Izhikevich(norse.tonic_spiking)
    )
    with torch.no_grad():
        model[0].lifted_module.weight.mul_(300.0)
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


def _izhikevich(field: Tensor) -> nn.Module:
    p = norse.tonic_spiking.p._replace(b=field)
    return norse.IzhikevichCell(norse.IzhikevichSpikingBehavior(p, norse.tonic_spiking.s))


def _refrac(field: Tensor) -> nn.Module:
    return norse.LIFRefracCell(norse.LIFRefracParameters(norse.LIFParameters(v_th=field)))


@pytest.mark.parametrize(
    ("make", "value", "gain"),
    [(_izhikevich, 0.2, 300.0), (_refrac, 1.0, 15.0)],
    ids=["IzhikevichCell b", "LIFRefracCell v_th"],
)
def test_a_learnable_parameter_field_keeps_the_per_step_call(
    make: Callable[[Tensor], nn.Module], value: float, gain: float
) -> None:
    """The kernels take no gradient for the parameters' fields: a cell with a learnable one
    (an ``nn.Parameter`` in its NamedTuple) runs per step layer-wise, and every gradient, the
    field's too, is Norse's loop's at round-off; the same cell with the field fixed runs
    fused."""
    torch.manual_seed(2)
    field = nn.Parameter(torch.full((6,), value))
    net = nn.Sequential(nn.Linear(4, 6), make(field))
    with torch.no_grad():
        net[0].weight.mul_(gain)
    x = (torch.rand(10, 2, 4) < 0.5).float() * 2
    want = norse_loop(lambda x_t, s: net[1](net[0](x_t), s), x)
    assert want.sum() > 0
    check_learnable_field(net, x, field, want)


@pytest.mark.parametrize("method", ["super", "triangle"])
def test_a_refractory_period_across_chunk_boundaries_matches_norses_loop(method: str) -> None:
    """``LIFRefracCell`` with a strong input (neurons fire, then hold for ``rho_reset`` = 5
    steps) and an initial state already refractory (``rho`` from 0 to 5.5, some fractional),
    chunks of 3: refractory periods run across chunk boundaries. The fused run gives Norse's
    loop's spikes and membranes bitwise, its final state (``v``, ``i``, ``rho``) bitwise, and
    its gradients (input, weight, initial ``v``, ``i`` and ``rho``: the mask's surrogate) at
    round-off."""
    torch.manual_seed(4)
    p = norse.LIFRefracParameters(norse.LIFParameters(method=method, alpha=0.5))
    net = nn.Sequential(nn.Linear(4, 6), norse.LIFRefracCell(p))
    with torch.no_grad():
        net[0].weight.mul_(20.0)
    x = ((torch.rand(14, 3, 4) < 0.6).float()).requires_grad_()
    v0 = torch.linspace(0.0, 0.95, 18).reshape(3, 6).requires_grad_()
    i0 = torch.linspace(-1.0, 2.0, 18).reshape(3, 6).requires_grad_()
    rho0 = (torch.arange(18.0).reshape(3, 6) % 12 / 2).requires_grad_()  # 0 to 5.5
    start = LIFRefracFeedForwardState(LIFFeedForwardState(v0, i0), rho0)
    spikes, mems, rhos, s = [], [], [], start
    for x_t in x:
        z, s = net[1](net[0](x_t), s)
        spikes.append(z)
        mems.append(s.lif.v)
        rhos.append(s.rho)
    counters = torch.stack(rhos)
    assert (counters[2::3] > 0).sum() > 10  # refractory at the last step of a chunk
    assert (counters[2::3] > 1).sum() > 5  # and still at the first of the next
    want = torch.cat([torch.stack(spikes).flatten(), torch.stack(mems).flatten()])
    want = torch.cat([want, *(t.flatten() for t in (s.lif.v, s.lif.i, s.rho))])
    w = torch.linspace(-1, 1, want.numel())
    wrt = [x, net[0].weight, v0, i0, rho0]
    want_grads = torch.autograd.grad((want * w).sum(), wrt)
    seq = sc.wrap(
        net, granularity="layer", chunk=3, output="both", exact=True
    )  # bitwise: products step by step (a chunk's rounds otherwise on some BLAS kernels)
    (got_spikes, got_v), final = seq(x, state=[None, start], return_state=True)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    got = torch.cat([got_spikes.flatten(), got_v.flatten()])
    got = torch.cat([got, *(t.flatten() for t in (final[1].lif.v, final[1].lif.i, final[1].rho))])
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad((got * w).sum(), wrt)
    for a, b in zip(want_grads, got_grads, strict=True):
        assert a.abs().sum() > 0
        close(a, b)


class _ClampedIzhikevich(norse.IzhikevichCell):
    """A subclass with a forward of its own (the membrane clamped after the step)."""

    def forward(self, x: Tensor, state: Any = None) -> Any:
        z, s = super().forward(x, state)
        return z, s._replace(v=s.v.clamp(max=0.0))


def test_a_subclass_with_a_forward_of_its_own_keeps_the_per_step_call() -> None:
    """The kernel never runs a subclass's forward (the check on random data may miss what it
    adds): it runs per step, as Norse's loop."""
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(4, 6), _ClampedIzhikevich(norse.tonic_spiking))
    with torch.no_grad():
        net[0].weight.mul_(300.0)
    x = (torch.rand(10, 2, 4) < 0.5).float()
    seq = sc.wrap(net, granularity="layer", chunk=4)
    got = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["per-step"]
    with torch.no_grad():
        want = norse_loop(lambda x_t, s: net[1](net[0](x_t), s), x)
    assert want.sum() > 0
    assert torch.equal(got, want)


def _set_dt(cell: nn.Module) -> None:
    cell.dt = 0.0005


def _set_forward(cell: nn.Module) -> None:
    def forward(x: Tensor, state: Any = None) -> Any:
        z, s = type(cell).forward(cell, x, state)
        return z, s._replace(v=s.v.clamp(max=0.0))

    cell.forward = forward


def _set_activation(cell: nn.Module) -> None:
    from norse.torch.functional.lif_refrac import lif_refrac_feed_forward_step

    def clamped(x: Tensor, s: Any, p: Any, dt: float) -> Any:
        z, s = lif_refrac_feed_forward_step(x, s, p, dt)
        return z, s._replace(lif=s.lif._replace(v=s.lif.v.clamp(max=0.5)))

    cell.activation = clamped


@pytest.mark.parametrize(
    ("cell", "change"),
    [
        (lambda: norse.IzhikevichCell(norse.tonic_spiking), _set_dt),
        (lambda: norse.IzhikevichCell(norse.tonic_spiking), _set_forward),
        (lambda: norse.LIFRefracCell(), _set_dt),
        (lambda: norse.LIFRefracCell(), _set_activation),
    ],
    ids=["IzhikevichCell dt", "IzhikevichCell forward", "LIFRefracCell dt", "activation"],
)
def test_a_cell_changed_after_the_first_forward_is_not_fused_with_its_old_step(
    cell: Callable[[], nn.Module], change: Callable[[nn.Module], None]
) -> None:
    """A cell whose ``dt``, ``forward`` or ``activation`` changes after its first layer-wise
    forward: the old kernel declines (its step is no longer the cell's), the block is made
    again from the cell as it is now, as a fresh wrap makes it (fused with the new ``dt``,
    else per step), bitwise Norse's loop."""
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(4, 6), cell())
    with torch.no_grad():
        net[0].weight.mul_(300.0 if isinstance(net[1], norse.IzhikevichCell) else 15.0)
    x = (torch.rand(10, 2, 4) < 0.5).float()
    seq = sc.wrap(net, granularity="layer", chunk=4)
    seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    old = seq.layer_blocks(True)[0].fused.kernel
    z = torch.zeros(4, 2, 6)
    assert old.accepts([z[0]] * old.leaf_count, z)
    change(net[1])
    assert not old.accepts([z[0]] * old.leaf_count, z)
    got = seq(x)
    fresh = sc.wrap(net, granularity="layer", chunk=4)
    fresh(x)
    ran = [b.neuron for b in seq.last_stats.blocks]
    assert ran == [b.neuron for b in fresh.last_stats.blocks]
    assert ran == (["fused"] if change is _set_dt else ["per-step"])
    with torch.no_grad():
        want = norse_loop(lambda x_t, s: net[1](net[0](x_t), s), x)
    assert want.sum() > 0
    assert torch.equal(got.detach(), want)


@pytest.mark.parametrize("name", ["IzhikevichCell", "LIFRefracCell"])
def test_a_float64_model_runs_fused_at_float64_round_off(name: str) -> None:
    """``model.double()`` (Norse's float32 0-d parameters beside float64 states, Python
    numbers): fused, the spikes bitwise Norse's loop's, the gradients within 1e-12 (the
    backward's coefficients are made in the state's dtype)."""
    torch.manual_seed(6)
    make, (gain, _) = CELLS[name]
    net = nn.Sequential(nn.Linear(4, 6), make()).double()
    with torch.no_grad():
        net[0].weight.mul_(gain)
    x = (torch.rand(11, 2, 4) < 0.5).double().requires_grad_()
    want = norse_loop(lambda x_t, s: net[1](net[0](x_t), s), x)
    assert want.sum() > 0
    want_grads = torch.autograd.grad(want.sum(), [x, net[0].weight])
    seq = sc.wrap(net, granularity="layer", chunk=4)
    got = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    assert got.dtype == torch.float64 and torch.equal(got, want)
    for a, b in zip(want_grads, torch.autograd.grad(got.sum(), [x, net[0].weight]), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12 * float(a.abs().max()))
