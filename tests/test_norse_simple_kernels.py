"""Norse's ``IAFCell`` / ``IAF``, ``LIBoxCell`` and ``coba_lif_feed_forward_step`` fused
(`spikeckpt.adapters.simple_kernels`), beyond the table of ``test_fused.py``: in Norse's own
containers, with learnable parameter fields (IAF's and LIBox's gradients from the kernel,
CobaLIF's per-step call), and with the step changed since the wrap (the per-step call)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from norse_cells import CobaLIFFeedForward, CobaLIFFeedForwardCell, close, norse_loop
from torch import Tensor, nn

import spikeckpt as sc

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse
    from norse.torch.functional.coba_lif import CobaLIFFeedForwardState, CobaLIFParameters
    from norse.torch.functional.iaf import IAFFeedForwardState
    from norse.torch.functional.leaky_integrator_box import LIBoxState

#: each cell and the gain of its input weights (the conductances need more to spike)
CELLS: dict[str, tuple[Callable[[], nn.Module], float]] = {
    "IAFCell": (lambda: norse.IAFCell(), 1.0),
    "LIBoxCell": (lambda: norse.LIBoxCell(), 1.0),
    "CobaLIF": (lambda: CobaLIFFeedForwardCell(CobaLIFParameters(c_m_inv=torch.tensor(60.0))), 8),
}


def _weighted(y: Tensor) -> Tensor:
    return (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()


@pytest.mark.parametrize("name", sorted(CELLS))
def test_a_sequential_state_of_the_cells_runs_fused_as_norses_loop(name: str) -> None:
    """``SequentialState(Linear, cell, Linear, cell)`` layer-wise (T = 13, chunks of 4: the
    last one short): both cells fused, the outputs bitwise Norse's loop's, the loss's
    gradients (both weights, the input) at round-off. ``IAFCell()`` is Norse's default,
    whose ``initial_state`` makes ``v_reset`` take a gradient: the kernel gives it one."""
    make, gain = CELLS[name]
    torch.manual_seed(0)
    model = norse.SequentialState(nn.Linear(4, 8), make(), nn.Linear(8, 3), make())
    with torch.no_grad():
        model[0].weight.mul_(4.0 * gain)
        model[2].weight.mul_(6.0 * gain)
    x = ((torch.rand(13, 2, 4) < 0.5).float() * 2).requires_grad_()
    wrt = [x, *model.parameters()]
    want = norse_loop(model, x)
    assert want.sum() != 0 and (name == "LIBoxCell" or want.sum() < want.numel())
    want_grads = torch.autograd.grad(_weighted(want), wrt)
    seq = sc.wrap(
        model, granularity="layer", chunk=4, exact=True
    )  # bitwise: products step by step (a chunk's rounds otherwise on some BLAS kernels)
    got, _ = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    assert torch.equal(got, want)
    for a, b in zip(want_grads, torch.autograd.grad(_weighted(got), wrt), strict=True):
        assert a.abs().sum() > 0
        close(a, b)


@pytest.mark.parametrize("module", ["IAF", "CobaLIFFeedForward"])
def test_the_sequence_modules_run_fused_as_norses_loop(module: str) -> None:
    """Norse's ``IAF`` (Norse 1.1.0 has no ``LIBox`` nor a feed-forward ``CobaLIF``: a
    sequence module of ``coba_lif_feed_forward_step`` built as Norse builds ``IAF``) in
    ``SequentialState(Lift(Linear), module)``: fused layer-wise, the spikes bitwise and the
    gradients at round-off of Norse's own call on the whole sequence."""
    torch.manual_seed(1)
    coba = module == "CobaLIFFeedForward"
    neuron = CobaLIFFeedForward(CobaLIFParameters(c_m_inv=torch.tensor(60.0))) if coba else None
    model = norse.SequentialState(norse.Lift(nn.Linear(4, 6)), neuron or norse.IAF())
    with torch.no_grad():
        model[0].lifted_module.weight.mul_(40.0 if coba else 5.0)
    x = ((torch.rand(11, 3, 4) < 0.5).float() * 2).requires_grad_()
    want, _ = model(x)
    assert 0 < want.sum() < want.numel()
    want_grads = torch.autograd.grad(_weighted(want), [x, *model.parameters()])
    seq = sc.wrap(model, granularity="layer", chunk=3)
    got, _ = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad(_weighted(got), [x, *model.parameters()])
    for a, b in zip(want_grads, got_grads, strict=True):
        close(a, b)


def _learnable(name: str) -> tuple[nn.Module, list[nn.Parameter], Any]:
    """A cell with learnable fields (``nn.Parameter`` in its NamedTuple), those fields and a
    start state ``(2, 6)`` (Norse's own start of ``IAFCell`` is ``v_reset`` itself: see
    `test_iafs_own_start_is_v_reset_and_takes_its_gradient`)."""
    zeros = torch.zeros(2, 6)
    if name == "IAFCell":
        fields = [nn.Parameter(torch.linspace(0.5, 1.5, 6)), nn.Parameter(torch.tensor(-0.3))]
        cell = norse.IAFCell(norse.IAFParameters(v_th=fields[0], v_reset=fields[1]))
        return cell, fields, IAFFeedForwardState(v=zeros + 0.2)
    if name == "LIBoxCell":
        fields = [nn.Parameter(torch.full((6,), 90.0)), nn.Parameter(torch.tensor(0.3))]
        cell = norse.LIBoxCell(norse.LIBoxParameters(tau_mem_inv=fields[0], v_leak=fields[1]))
        return cell, fields, LIBoxState(v=zeros + 0.2)
    fields = [nn.Parameter(torch.tensor(60.0))]
    cell = CobaLIFFeedForwardCell(CobaLIFParameters(c_m_inv=fields[0]))
    return cell, fields, CobaLIFFeedForwardState(v=zeros - 20.0, g_e=zeros, g_i=zeros)


@pytest.mark.parametrize("name", sorted(CELLS))
def test_learnable_fields_match_norses_loop(name: str) -> None:
    """Learnable fields: IAF's ``v_th`` and ``v_reset`` and LIBox's ``tau_mem_inv`` and
    ``v_leak`` run fused, their gradients from the kernel; CobaLIF's ``c_m_inv`` keeps the
    per-step call (fused again once it is fixed). The spikes bitwise Norse's loop's, every
    gradient (the fields', the weight's, the input's, the start state's) at round-off."""
    torch.manual_seed(2)
    cell, fields, start = _learnable(name)
    net = nn.Sequential(nn.Linear(4, 6), cell)
    with torch.no_grad():
        net[0].weight.mul_(4.0 * CELLS[name][1])
    x = ((torch.rand(10, 2, 4) < 0.5).float() * 2).requires_grad_()
    v0 = start.v.clone().requires_grad_()
    start = start._replace(v=v0)
    wrt = [*fields, x, *net.parameters(), v0]
    want = norse_loop(lambda x_t, s: cell(net[0](x_t), s), x, start)
    assert want.sum() > 0 and (name == "LIBoxCell" or want.sum() < want.numel())
    want_grads = torch.autograd.grad(_weighted(want), wrt)
    seq = sc.wrap(net, granularity="layer", chunk=4)
    got = seq(x, state=[None, start])
    fused = "per-step" if name == "CobaLIF" else "fused"
    assert [b.neuron for b in seq.last_stats.blocks] == [fused]
    assert torch.equal(got, want)
    for a, b in zip(want_grads, torch.autograd.grad(_weighted(got), wrt), strict=True):
        assert a.abs().sum() > 0
        close(a, b)
    for f in fields:
        f.requires_grad_(False)
    seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]


def _own_forward(cell: nn.Module) -> None:
    cell.forward = lambda x_t, s=None: type(cell).forward(cell, x_t, s)  # type: ignore[method-assign]


def _wrapped_activation(cell: nn.Module) -> None:
    step = cell.activation
    cell.activation = lambda x, s, p, dt: step(x, s, p, dt)


@pytest.mark.parametrize("name", sorted(CELLS))
@pytest.mark.parametrize(
    ("change", "then"),
    [
        (lambda c: setattr(c, "dt", 0.002), "fused"),
        (_wrapped_activation, "per-step"),
        (_own_forward, "per-step"),
    ],
    ids=["dt", "activation", "forward"],
)
def test_a_step_changed_since_the_wrap_is_not_fused_with_its_old_step(
    name: str, change: Callable[[nn.Module], None], then: str
) -> None:
    """A cell whose ``dt``, ``activation`` or ``forward`` changed since its first layer-wise
    forward: the block is made again from the cell as it is now (a new ``dt``: a new kernel;
    another activation or a forward of its own: per step), as a fresh wrap makes it, bitwise
    Norse's loop with the change."""
    torch.manual_seed(3)
    cell = CELLS[name][0]()
    net = nn.Sequential(nn.Linear(4, 6), cell)
    with torch.no_grad():
        net[0].weight.mul_(4.0 * CELLS[name][1])
    x = (torch.rand(9, 2, 4) < 0.5).float() * 2
    seq = sc.wrap(
        net, granularity="layer", chunk=4, exact=True
    )  # bitwise: products step by step (a chunk's rounds otherwise on some BLAS kernels)
    seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    change(cell)
    got = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == [then]
    assert torch.equal(got, norse_loop(lambda x_t, s: cell(net[0](x_t), s), x))


@pytest.mark.parametrize("name", ["IAFCell", "CobaLIF"])
def test_a_spike_method_changed_since_the_wrap_is_read_at_each_chunk(name: str) -> None:
    """Every spike ``method`` of Norse's ``threshold`` is fused: one changed since the wrap
    (``"super"`` to ``"tanh"``) keeps the kernel, whose surrogate then is the new one (the
    gradients Norse's loop's with the change)."""
    make, gain = CELLS[name]
    torch.manual_seed(4)
    cell = make()
    net = nn.Sequential(nn.Linear(4, 6), cell)
    with torch.no_grad():
        net[0].weight.mul_(4.0 * gain)
    x = ((torch.rand(9, 2, 4) < 0.5).float() * 2).requires_grad_()
    seq = sc.wrap(net, granularity="layer", chunk=4)
    seq(x)
    cell.p = cell.p._replace(method="tanh", alpha=torch.tensor(3.0))
    wrt = [x, *net.parameters()]
    want = norse_loop(lambda x_t, s: cell(net[0](x_t), s), x)
    want_grads = torch.autograd.grad(_weighted(want), wrt)
    got = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    assert torch.equal(got, want)
    for a, b in zip(want_grads, torch.autograd.grad(_weighted(got), wrt), strict=True):
        close(a, b)


@pytest.mark.parametrize("granularity", ["layer", "stack"])
def test_iafs_own_start_is_v_reset_and_takes_its_gradient(granularity: str) -> None:
    """Norse's ``IAFCell.initial_state`` starts ``v`` at ``p.v_reset`` itself (and sets its
    ``requires_grad``): in Norse's loop ``v_reset``'s gradient has a path through the start
    as well as through each reset. The wrapped model (no state given: Norse's own start)
    keeps that path, in both granularities: ``v_reset.grad`` -2.1386 as Norse's loop, where
    the detached start gave -1.8517."""
    torch.manual_seed(0)
    v_reset = nn.Parameter(torch.tensor(0.1))
    cell = norse.IAFCell(norse.IAFParameters(v_th=torch.tensor(1.0), v_reset=v_reset))
    model = norse.SequentialState(nn.Linear(4, 6), cell, nn.Linear(6, 3), norse.LICell())
    x = (torch.rand(13, 2, 4) < 0.5).float() * 2
    want = norse_loop(model, x)
    _weighted(want).backward()
    want_grads = [p.grad for p in (v_reset, *model.parameters())]
    v_reset.grad = None
    model.zero_grad(set_to_none=True)
    plan = {"chunk": 4} if granularity == "layer" else {"plan": sc.plans.Uniform(4)}
    seq = sc.wrap(model, granularity=granularity, **plan)
    _weighted(seq(x)[0]).backward()
    if granularity == "layer":
        assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    for a, b in zip(want_grads, [p.grad for p in (v_reset, *model.parameters())], strict=True):
        assert a is not None and b is not None and a.abs().sum() > 0
        close(a, b)
