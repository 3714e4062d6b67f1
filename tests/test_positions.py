"""The non-zeros of a dense chunk listed for the sparse gather (`affine.weight_positions`):
the compiled listing (`affine._listed`) gives the NumPy listing's rows, columns, values and
index dtype exactly, for spikes, graded values, NaN, infinities and signed zeros, float32 and
float64, any length (not only multiples of the 8-byte words it skips); a chunk that no flat
view reads (a batch-first input's) is listed and counted where it lies, as its copy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import spikeckpt as sc
from spikeckpt.adapters import affine
from spikeckpt.adapters.affine import SparseLimit, weight_positions
from spikeckpt.storage.codecs import count_binary


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


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(2, 6),
    b=st.integers(2, 5),
    n_in=st.integers(1, 37),
    density=st.sampled_from([0.0, 0.02, 0.1, 0.3]),
    graded=st.booleans(),
    odd=st.sampled_from(["none", "nan", "inf", "-0"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    layout=st.sampled_from(["batch-first", "sliced-batch", "rows-apart"]),
    seed=st.integers(0, 2**16),
)
def test_a_chunk_no_flat_view_reads_is_listed_and_counted_as_its_copy(
    k: int,
    b: int,
    n_in: int,
    density: float,
    graded: bool,
    odd: str,
    dtype: torch.dtype,
    layout: str,
    seed: int,
) -> None:
    """A chunk of a permuted (batch-first) input, whose ``(rows, in)`` view does not exist,
    is read where it lies (`affine._listed_strided`, `codecs.count_binary`): the positions,
    values, index dtype and counts of its contiguous copy."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.rand(b, k + 2, 2 * n_in, generator=g) < density).to(dtype)
    if graded:
        base = base * torch.randn(base.shape, generator=g, dtype=dtype)
    if odd != "none":
        base.view(-1)[torch.randint(0, base.numel(), (2,), generator=g)] = float(odd)
    x = {
        "batch-first": base.permute(1, 0, 2)[1 : k + 1, :, :n_in],
        "sliced-batch": base.permute(1, 0, 2)[:k, ::2, n_in:],
        "rows-apart": base.permute(1, 0, 2)[:k],
    }[layout]
    weight = torch.randn(4096, x.shape[-1], dtype=dtype)
    got = weight_positions(x, weight, SparseLimit())
    want = weight_positions(x.contiguous(), weight, SparseLimit())
    assert count_binary(x) == count_binary(x.contiguous())
    assert (got is None) == (want is None)
    if got is None or want is None:
        return
    assert got[0] == want[0]
    for a, c in zip(got[1:3], want[1:3], strict=True):
        assert a.dtype == c.dtype and torch.equal(a, c)
    assert (got[3] is None) == (want[3] is None)
    if got[3] is not None and want[3] is not None:
        assert torch.equal(got[3].nan_to_num(), want[3].nan_to_num())
        assert torch.equal(got[3].signbit(), want[3].signbit())


@pytest.mark.parametrize(
    ("shape", "order"),
    [((0, 4, 30), (1, 0, 2)), ((2, 0, 4, 30), (2, 0, 1, 3)), ((5, 4, 0), (1, 0, 2))],
)
def test_an_empty_batch_first_chunk_is_listed_as_its_copy(
    shape: tuple[int, ...], order: tuple[int, ...]
) -> None:
    """A permuted chunk with no elements (no rows, or no input features: its ``(k, rows,
    in)`` view is ambiguous) lists as its copy does (no features raised in the view)."""
    x = torch.zeros(shape).permute(order)
    weight = torch.randn(300, x.shape[-1])
    got, want = (weight_positions(t, weight, SparseLimit()) for t in (x, x.contiguous()))
    assert got is not None and want is not None and got[0] == want[0] == x.shape[:-1].numel()
    assert all(a.numel() == c.numel() == 0 for a, c in zip(got[1:3], want[1:3], strict=True))
    assert count_binary(x) == count_binary(x.contiguous()) == (0, True)


def test_a_batch_first_chunk_is_not_copied() -> None:
    """Listing and counting a chunk of a permuted input allocate far less than its float
    copy (which the planner measured as working memory: it gave batch-first inputs 1.7x
    shorter layer-wise chunks): a boolean mask and the positions."""
    x = torch.rand(16, 60, 700, generator=torch.Generator().manual_seed(0)) < 0.03
    chunk = x.float().permute(1, 0, 2)[:30]
    weight = torch.randn(4096, 700)
    with sc.MemoryMeter() as meter:
        assert weight_positions(chunk, weight, SparseLimit()) is not None
        count_binary(chunk)
    assert meter.peak_bytes < chunk.numel() * 4 / 2
