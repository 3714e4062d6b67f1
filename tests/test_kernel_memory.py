"""Norse's feed-forward kernel (`spikeckpt.adapters.kernels.NorseKernel`) backward keeps only
what the wanted gradients read: without learnable fields in ``p`` it holds neither the drive
``(v_leak - v) + i'`` nor the per-step gradients that only the fields' gradients read.
Measured with `MemoryMeter` in units of one chunk-sized tensor ``(k, B, n)``: LIF 8.1 -> 6.0,
LI 6.1 -> 4.0, box 7.1 -> 6.0 (2026-11-27); LIF and box 1.1 since their forward keeps only the
membranes before each reset and one compiled pass takes the spike's slope from them
(2026-11-28, `test_norse_lean`). Each field learnable alone still gets the gradient of the
path that keeps everything (the torch loop, ``USE_JIT`` off)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.adapters import host_loops

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse
    from norse.torch.functional.reset import reset_subtract

    from spikeckpt.adapters.norse import norse_kernel

K, B, N = 20, 4, 64


def _run(cell: nn.Module, params: list[Tensor]) -> tuple[float, list[Tensor | None]]:
    """One chunk forward and backward through the cell's kernel: the backward's peak (in
    chunk-sized tensors) and the gradients of ``z``, the start state and ``params``."""
    kernel = norse_kernel(cell)
    assert kernel is not None
    torch.manual_seed(0)
    z = torch.randn(K, B, N) * 3
    n_leaves = 1 if isinstance(cell, norse.LIFBoxCell) else 2
    leaves = [torch.zeros(B, N) for _ in range(n_leaves)]
    _, y, _, saved = kernel.forward(leaves, z, True, False)
    g_y = torch.linspace(-1, 1, y.numel()).view_as(y)
    with sc.MemoryMeter() as meter:
        g_z, g_state, g_params = kernel.backward(
            saved, g_y, [None] * n_leaves, None, True, [True] * len(params)
        )
    return meter.peak_bytes / (K * B * N * 4), [g_z, *g_state, *g_params]


@pytest.mark.parametrize(
    ("make", "bound"),
    [(norse.LIFCell, 1.5), (norse.LICell, 4.5), (norse.LIFBoxCell, 1.5)],
    ids=["lif", "li", "box"],
)
def test_the_backward_holds_less_without_learnable_fields(make: Any, bound: float) -> None:
    peak, grads = _run(make(), [])
    assert grads[0] is not None and grads[0].abs().sum() > 0
    assert peak <= bound, f"{peak:.2f} chunk-sized tensors at the backward's peak"


def _lif(field: str) -> tuple[nn.Module, list[Tensor]]:
    value = {"tau_mem_inv": 90.0, "tau_syn_inv": 150.0, "v_leak": 0.1, "v_th": 0.5}
    value["v_reset"] = -0.1
    learnable = nn.Parameter(torch.tensor(value[field]))
    return norse.LIFCell(norse.LIFParameters(**{field: learnable})), [learnable]


def _box_subtract(field: str) -> tuple[nn.Module, list[Tensor]]:
    learnable = nn.Parameter(torch.tensor({"tau_mem_inv": 90.0, "v_leak": 0.1, "v_th": 0.4}[field]))
    p = norse.LIFBoxParameters(reset_method=reset_subtract, **{field: learnable})
    return norse.LIFBoxCell(p), [learnable]


CASES: dict[str, Callable[[], tuple[nn.Module, list[Tensor]]]] = {
    **{f"lif {f}": (lambda f=f: _lif(f)) for f in ("tau_mem_inv", "tau_syn_inv", "v_leak")},
    **{f"lif {f}": (lambda f=f: _lif(f)) for f in ("v_th", "v_reset")},
    **{f"box-subtract {f}": (lambda f=f: _box_subtract(f)) for f in ("tau_mem_inv", "v_th")},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_learnable_field_gets_the_full_paths_gradient(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cell, params = CASES[case]()
    _, got = _run(cell, params)
    monkeypatch.setattr(host_loops, "USE_JIT", False)
    _, want = _run(cell, params)
    assert got[-1] is not None and got[-1].abs().sum() > 0
    for a, b in zip(want, got, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            torch.testing.assert_close(
                b, a, rtol=1e-5, atol=1e-6 * (1 + float(a.detach().abs().max()))
            )
