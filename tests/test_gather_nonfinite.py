"""A NaN or an infinity reaches the gathered ``Linear`` as it reaches the loop's dense
product: a weight with one keeps the dense product (the loop's ``0 * nan`` is NaN where a
gather over the input's non-zeros skips it), and a gradient with one takes the dense weight
gradient (``inf * 0``), so the NaNs of outputs and gradients are the loop's."""

from __future__ import annotations

import copy
import warnings

import pytest
import snntorch as snn
import torch
from norse_cells import counted_gathers, norse_loop
from snn_loops import gather_calls, leaky_loop
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.adapters.gather import finite, gather_weight_grad

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as nt


def _net(n_in: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(n_in, hidden), snn.Leaky(0.9), nn.Linear(hidden, 4), snn.Leaky(0.9)
    )


def _x(T: int, B: int, n_in: int) -> Tensor:
    return (torch.rand(T, B, n_in, generator=torch.Generator().manual_seed(1)) < 0.02).float()


def test_a_weight_with_a_nan_is_not_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN in a column of the first weight whose input never fires: the loop's membranes
    are NaN everywhere (``0 * nan``), the wrapped run's too (it was finite: the gather
    skipped the column); a finite weight still gathers."""
    net = _net(40, 1024)
    x = _x(6, 2, 40)
    x[:, :, 3] = 0
    calls = gather_calls(monkeypatch)
    sc.wrap(copy.deepcopy(net), granularity="layer", chunk=3)(x)
    assert calls  # the finite weight gathers
    with torch.no_grad():
        net[0].weight[:, 3] = float("nan")
    _, want = leaky_loop(copy.deepcopy(net[:2]), x)
    calls.clear()
    got = sc.wrap(net[:2], granularity="layer", chunk=3, output="mem")(x)
    assert not calls and want.isnan().all() and got.isnan().all()


@pytest.mark.parametrize("odd", [float("nan"), float("inf")])
def test_a_nan_input_gives_the_loops_weight_gradient(odd: float) -> None:
    """A NaN or an infinity in the input: the loop's weight gradient has NaN where the
    wrapped run's has (a NaN input: its step's gradient is NaN at every neuron, so every
    column, not only the inputs that fired: ``nan * 0``); the finite entries within
    round-off."""
    net = _net(40, 1024)
    x = _x(6, 2, 40)
    x[2, 1, 5] = odd
    ref = copy.deepcopy(net)
    spk, _ = leaky_loop(ref, x)
    spk.sum().backward()
    seq = sc.wrap(net, granularity="layer", chunk=3)
    seq(x).sum().backward()
    for got, want in zip(net.parameters(), ref.parameters(), strict=True):
        assert got.grad is not None and want.grad is not None
        assert torch.equal(got.grad.isnan(), want.grad.isnan())
        torch.testing.assert_close(got.grad.nan_to_num(), want.grad.nan_to_num())
    if odd != odd:  # NaN: every neuron's gradient at its step (an infinity's slope is 0)
        silent = (x == 0).all(1).all(0)  # inputs that never fire: a gather skipped them
        assert net[0].weight.grad[:, silent].isnan().all()


def test_gather_weight_grad_with_an_infinity_is_the_dense_product() -> None:
    """`gather_weight_grad` of a gradient with an infinity (or a NaN), spikes or graded
    values, into a sum or not: the dense product's NaNs and infinities, its values within
    round-off; `finite` says which."""
    gen = torch.Generator().manual_seed(3)
    flat = (torch.rand(12, 9, generator=gen) < 0.2).float()
    flat[0, 0] = 1.0
    rows, cols = (t.to(torch.int32) for t in flat.nonzero(as_tuple=True))
    for values in (None, torch.randn(rows.shape[0], generator=gen)):
        dense = flat.clone()
        if values is not None:
            dense[rows.long(), cols.long()] = values
        for odd in (float("inf"), float("nan")):
            grad = torch.randn(12, 5, generator=gen)
            grad[7, 2] = odd
            assert finite(flat) and not finite(grad)
            want = grad.t().mm(dense)
            got = gather_weight_grad(grad, rows, cols, values, (5, 9), None)
            start = torch.ones(5, 9)
            summed = gather_weight_grad(grad, rows, cols, values, (5, 9), start.clone())
            for result, base in ((got, 0.0), (summed, 1.0)):
                assert torch.equal(result.isnan(), want.isnan())
                assert torch.equal(result.isinf(), want.isinf())
                torch.testing.assert_close(result.nan_to_num(), (want + base).nan_to_num())


def test_a_weight_made_nan_through_data_between_calls_is_not_gathered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A weight's finiteness is summed once per pass of the engine: a NaN written through
    ``.data`` between two calls (no version bump) is seen by the next call, which then keeps
    the dense product, as the loop's NaN membranes."""
    net = _net(40, 1024)[:2]
    x = _x(6, 2, 40)
    x[:, :, 3] = 0
    seq = sc.wrap(net, granularity="layer", chunk=3, output="mem")
    calls = gather_calls(monkeypatch)
    assert seq(x).isfinite().all() and calls
    version = net[0].weight._version
    net[0].weight.data[:, 3] = float("nan")
    assert net[0].weight._version == version  # unseen by a cache keyed on the version alone
    calls.clear()
    got = seq(x)
    _, want = leaky_loop(copy.deepcopy(net), x)
    assert not calls and want.isnan().all() and got.isnan().all()


def test_a_norse_cells_input_weight_made_nan_between_calls_is_not_gathered() -> None:
    """The same for a Norse recurrent cell's own input product (its kernel's gather): the
    second call, after a NaN written through ``.data`` in an input column that never fires,
    gives the loop's spikes and does not gather."""
    torch.manual_seed(0)
    cell = nt.LIFRecurrentCell(40, 64)
    with torch.no_grad():
        cell.input_weights.mul_(20)
    x = _x(8, 2, 40)
    x[:, :, 3] = 0
    seq = sc.wrap(nt.SequentialState(cell), granularity="layer", chunk=4)
    with counted_gathers() as calls:
        seq(x)
        assert calls
        cell.input_weights.data[:, 3] = float("nan")
        calls.clear()
        got = seq(x)[0]
    assert not calls
    assert torch.equal(got, norse_loop(copy.deepcopy(nt.SequentialState(cell)), x))
