"""snnTorch's surrogate backwards written out for the fused kernels
(`spikeckpt.adapters.snntorch_surrogates`): bitwise snnTorch's own backward, run by autograd
as the loop runs it (the incoming gradient in the spike's output dtype, float32), for every
membrane dtype; any other spike function is left to its own backward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from spikeckpt.adapters.kernels import scales, surrogate_grad, vjp
from spikeckpt.adapters.snntorch_surrogates import written_grad

surrogate = pytest.importorskip("snntorch.surrogate")

SURROGATES: dict[str, Callable[[], Callable[[Tensor], Tensor]]] = {
    "atan": lambda: surrogate.atan(),
    "atan alpha 3": lambda: surrogate.atan(alpha=3.0),
    "fast_sigmoid": lambda: surrogate.fast_sigmoid(),
    "fast_sigmoid slope 5": lambda: surrogate.fast_sigmoid(slope=5),
    "sigmoid": lambda: surrogate.sigmoid(),
    "sigmoid slope 7": lambda: surrogate.sigmoid(slope=7),
    "triangular": lambda: surrogate.triangular(),
    "triangular threshold 2": lambda: surrogate.triangular(threshold=2),
}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SURROGATES))
def test_written_backward_is_snntorchs_bitwise(name: str, dtype: torch.dtype) -> None:
    spike = SURROGATES[name]()
    written = written_grad(spike)
    assert written is not None
    torch.manual_seed(0)
    u = torch.randn(40, 64, dtype=dtype) * 3  # sigmoid's exp overflows in float16: NaN there
    g = torch.randn(40, 64, dtype=spike(u).dtype)
    want = vjp(spike, u, g)
    got = written(u.clone(), g)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    # only atan's is a slope times the gradient: a recurrence takes it once per chunk
    assert scales(written) == name.startswith("atan")
    if scales(written):
        assert torch.equal((written(u.clone(), torch.ones_like(g)) * g).to(dtype), want)


def _mine(slope: float = 25.0) -> Callable[[Tensor], Tensor]:
    def inner(x: Tensor) -> Tensor:
        return surrogate.FastSigmoid.apply(x, slope)

    return inner


@pytest.mark.parametrize(
    "spike",
    [
        surrogate.fast_sigmoid(slope=torch.tensor(5.0)),  # a tensor constant
        surrogate.spike_rate_escape(),
        surrogate.straight_through_estimator(),
        _mine(),  # the same backward, written by a user
    ],
    ids=["tensor slope", "spike_rate_escape", "straight_through", "a user's"],
)
def test_other_spike_functions_keep_their_own_backward(spike: Callable[[Tensor], Tensor]) -> None:
    assert written_grad(spike) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SURROGATES))
def test_the_slope_without_a_tensor_of_ones_is_the_same(name: str, dtype: torch.dtype) -> None:
    """`surrogate_grad` given no gradient (the slope: ones broadcast from one value) and
    allowed to overwrite the membranes gives the values of a gradient of ones, bitwise."""
    spike = SURROGATES[name]()
    written = written_grad(spike)
    torch.manual_seed(1)
    mem = torch.randn(12, 3, 40, dtype=dtype) * 3
    thr = torch.tensor(0.5, dtype=dtype)
    want = surrogate_grad(spike, mem, thr, torch.ones_like(mem), written)
    kept = mem.clone()
    got = surrogate_grad(spike, mem, thr, None, written, overwrite=True)
    again = surrogate_grad(spike, kept, thr, None, written)
    for other in (want, again):  # sigmoid's exp overflows: NaN at the same places
        assert torch.equal(got.isnan(), other.isnan())
        assert torch.equal(got.nan_to_num(0.0), other.nan_to_num(0.0))
