"""The non-zeros of a dense chunk listed for the sparse gather (`affine.weight_positions`):
the compiled listing (`affine._listed`) gives the NumPy listing's rows, columns, values and
index dtype exactly, for spikes, graded values, NaN, infinities and signed zeros, float32 and
float64, any length (not only multiples of the 8-byte words it skips)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from spikeckpt.adapters import affine
from spikeckpt.adapters.affine import SparseLimit, weight_positions


def _both(x: Tensor, weight: Tensor) -> tuple[object, object]:
    compiled = weight_positions(x, weight, SparseLimit())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(affine, "_positions_jit", None)
        listed = weight_positions(x, weight, SparseLimit())
    return compiled, listed


@settings(max_examples=80, deadline=None)
@given(
    k=st.integers(1, 6),
    b=st.integers(1, 5),
    n_in=st.integers(1, 37),
    density=st.sampled_from([0.0, 0.02, 0.1, 0.3, 1.0]),
    graded=st.booleans(),
    odd=st.sampled_from(["none", "nan", "inf", "-0"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_the_compiled_listing_is_numpys(
    k: int,
    b: int,
    n_in: int,
    density: float,
    graded: bool,
    odd: str,
    dtype: torch.dtype,
    seed: int,
) -> None:
    assert affine._positions_jit is not None  # Numba is a dependency
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(k, b, n_in, generator=g) < density).to(dtype)
    if graded:
        x = x * torch.randn(x.shape, generator=g, dtype=dtype)
    if odd != "none":
        x.view(-1)[torch.randint(0, x.numel(), (2,), generator=g)] = float(odd)
    weight = torch.randn(4096, n_in, dtype=dtype)  # wide: its share of non-zeros is high
    compiled, listed = _both(x, weight)
    assert (compiled is None) == (listed is None)
    if compiled is None or listed is None:
        return
    assert isinstance(compiled, tuple) and isinstance(listed, tuple)
    assert compiled[0] == listed[0]
    for got, want in zip(compiled[1:3], listed[1:3], strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert (compiled[3] is None) == (listed[3] is None)
    if compiled[3] is not None:
        assert torch.equal(compiled[3].isnan(), listed[3].isnan())
        assert torch.equal(compiled[3].nan_to_num(), listed[3].nan_to_num())
        assert torch.equal(compiled[3].signbit(), listed[3].signbit())


def test_a_chunk_of_spikes_lists_ones_as_none() -> None:
    """A binary chunk (the usual input): positions in order, values None (weights summed
    as they are), 32-bit positions."""
    x = torch.zeros(3, 2, 10)
    x[0, 1, 4] = x[2, 0, 0] = x[2, 1, 9] = 1.0
    compiled, listed = _both(x, torch.randn(4096, 10))
    assert isinstance(compiled, tuple) and isinstance(listed, tuple)
    n_rows, rows, cols, values = compiled
    assert n_rows == 6 and values is None and rows.dtype == torch.int32
    assert rows.tolist() == [1, 4, 5] and cols.tolist() == [4, 0, 9]
    assert torch.equal(listed[1], rows) and torch.equal(listed[2], cols)
