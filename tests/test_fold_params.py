"""A callable readout (``fold(acc, y_t, t)``) that uses tensors requiring grad of its own: a
learnable readout matrix it closes over, a head module. Before 2026-11-29 scan and wrap
differentiated only what the step reaches, so those tensors were left at ``.grad`` None
while the plain loop trains them (silently: no error, the readout never learned)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc


def _setup() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(6, 5), torch.rand(10, 2, 6)


def _step(fc: nn.Linear):
    def step(v: torch.Tensor, x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = 0.9 * v + fc(x_t)
        return v, torch.tanh(v)

    return step


def _loop(step, x: torch.Tensor, fold) -> torch.Tensor:
    v, acc = torch.zeros(2, 5), None
    for t in range(x.shape[0]):
        v, y = step(v, x[t])
        acc = fold(acc, y, t)
    return acc


def _grads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


@pytest.mark.parametrize("plan", [sc.plans.BPTT(), sc.plans.Uniform(3), sc.plans.Revolve(2)])
@pytest.mark.parametrize("kind", ["closure", "module"])
def test_scan_differentiates_the_folds_tensors(plan, kind):
    fc, x = _setup()
    w = nn.Parameter(torch.randn(5, 3))
    head = nn.Linear(5, 3)
    if kind == "closure":

        def fold(acc, y, t):
            return y @ w if acc is None else acc + y @ w

        own = [w]
    else:

        def fold(acc, y, t):
            return head(y) if acc is None else acc + head(y)

        own = [head.weight, head.bias]
    tensors = [fc.weight, fc.bias, *own]
    step = _step(fc)
    _loop(step, x, fold).pow(2).sum().backward()
    expected = _grads(tensors)
    out, _ = sc.scan(step, x, torch.zeros(2, 5), plan=plan, readout=fold)
    out.pow(2).sum().backward()
    for t, e in zip(tensors, expected, strict=True):
        assert t.grad is not None
        torch.testing.assert_close(t.grad, e)


def test_scan_explicit_params_without_the_folds_tensor_is_refused():
    fc, x = _setup()
    w = nn.Parameter(torch.randn(5, 3))

    def fold(acc, y, t):
        return y @ w if acc is None else acc + y @ w

    with pytest.raises(sc.UnlistedParamsError, match="params"):
        sc.scan(
            _step(fc),
            x,
            torch.zeros(2, 5),
            plan=sc.plans.Uniform(3),
            readout=fold,
            params=[fc.weight, fc.bias],
        )


def test_fold_head_running_stats_updated_once_per_step():
    fc, x = _setup()
    bn = nn.BatchNorm1d(5)

    def fold(acc, y, t):
        return bn(y) if acc is None else acc + bn(y)

    out, _ = sc.scan(_step(fc), x, torch.zeros(2, 5), plan=sc.plans.Uniform(3), readout=fold)
    out.sum().backward()
    assert int(bn.num_batches_tracked) == x.shape[0]


def test_wrap_differentiates_the_folds_tensors():
    snn = pytest.importorskip("snntorch")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), snn.Leaky(beta=0.9, init_hidden=True))
    w = nn.Parameter(torch.randn(5, 3))
    x = (torch.rand(10, 2, 6) < 0.5).float()

    def fold(acc, y, t):
        return y @ w if acc is None else acc + y @ w

    def loop():
        net[1].reset_hidden()
        acc = None
        for t in range(x.shape[0]):
            acc = fold(acc, net(x[t]), t)
        return acc

    tensors = [*net.parameters(), w]
    loop().pow(2).sum().backward()
    expected = _grads(tensors)
    seq = sc.wrap(net, plan=sc.plans.Uniform(3), readout=fold)
    seq(x).pow(2).sum().backward()
    for t, e in zip(tensors, expected, strict=True):
        assert t.grad is not None
        torch.testing.assert_close(t.grad, e)
