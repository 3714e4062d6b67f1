"""Norse's threshold backwards written out for the fused kernels
(`spikeckpt.adapters.norse_surrogates`): bitwise Norse's own backward run by autograd, for
every membrane dtype, ``alpha`` a tensor (as ``LIFParameters`` holds it) or a number; the
kernels' spike functions carry it, read at each call (a method changed on ``p`` is followed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc
from spikeckpt.adapters.kernels import surrogate_grad, vjp
from spikeckpt.adapters.norse_surrogates import written_norse_grad

norse = pytest.importorskip("norse.torch")
from norse.torch.functional.threshold import threshold  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha", [torch.as_tensor(100.0), 2.5, torch.as_tensor(0.3)], ids=str)
@pytest.mark.parametrize("method", ["super", "tanh", "triangle"])
def test_written_backward_is_norses_bitwise(method: str, alpha: object, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    u = torch.randn(30, 50, dtype=dtype) * 2
    g = torch.randn(30, 50, dtype=dtype)
    written = written_norse_grad(method, alpha)
    assert written is not None
    want = vjp(lambda x: threshold(x, method, alpha), u, g)  # type: ignore[arg-type]
    got = written(u.clone(), g)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("method", ["circ", "heavi_erfc", "heaviside", "mine"])
def test_other_methods_keep_their_own_backward(method: str) -> None:
    assert written_norse_grad(method, 0.3) is None


def test_the_kernels_spike_follows_a_method_changed_on_p() -> None:
    # the slope a fused LIFCell takes: Norse's backward for the method p holds now
    from spikeckpt.adapters.norse import _norse_spike

    cell = norse.LIFCell(norse.LIFParameters(method="super"))
    spike = _norse_spike(cell)
    u, ones = torch.randn(4, 6), torch.ones(4, 6)
    for method in ["super", "tanh", "circ"]:
        cell.p = cell.p._replace(method=method)
        want = vjp(lambda x, m=method: threshold(x, m, cell.p.alpha), u, ones)
        assert torch.equal(surrogate_grad(spike, u, torch.zeros(()), ones), want), method


@pytest.mark.parametrize("method", ["super", "tanh", "triangle"])
def test_a_fused_lif_cell_trains_as_norses_loop(method: str) -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        p = norse.LIFParameters(method=method, v_th=torch.as_tensor(0.3))
        return norse.SequentialState(
            nn.Linear(10, 12), norse.LIFCell(p), nn.Linear(12, 4), norse.LICell()
        )

    torch.manual_seed(1)
    x = torch.rand(15, 3, 10) * 4
    net, wrapped = make(), make()
    state, outs = None, []
    for x_t in x:
        y, state = net(x_t, state)
        outs.append(y)
    torch.stack(outs).pow(2).sum().backward()
    seq = sc.wrap(wrapped, granularity="layer", chunk=4)
    seq(x)[0].pow(2).sum().backward()
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    for a, b in zip(net.parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", ["super", "tanh", "triangle"])
def test_the_slope_without_a_tensor_of_ones_is_norses(method: str, dtype: torch.dtype) -> None:
    """A Norse spike's slope (`surrogate_grad` given no gradient, overwriting the membranes
    it may) is Norse's backward for a gradient of ones, bitwise."""

    def spike(x: torch.Tensor) -> torch.Tensor:
        return threshold(x, method, 0.3)

    spike.written_grad = lambda: written_norse_grad(method, 0.3)  # type: ignore[attr-defined]
    torch.manual_seed(2)
    mem = torch.randn(10, 4, 30, dtype=dtype) * 2
    thr = torch.tensor(0.4, dtype=dtype)
    want = vjp(spike, mem - thr, torch.ones_like(mem))
    assert torch.equal(surrogate_grad(spike, mem.clone(), thr, None), want)
    assert torch.equal(surrogate_grad(spike, mem, thr, None, overwrite=True), want)
