"""The ``"sum"`` / ``"mean"`` readouts fed a chunk at a time (`Reducer.emit_chunk`, the
layer-wise job's path) against a running total ``acc = acc + y_t`` step by step: bitwise, in
every dtype, layout and chunking, with the outputs left unchanged (the running sums are added
into in place)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spikeckpt.engine.ordered_sum import add_steps_in_order
from spikeckpt.engine.readout import Reducer


def _running_total(ys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The plain loop's sum: ``acc = acc + y_t`` from ``y_0``, in ``dtype``."""
    acc = ys[0].to(dtype)
    for y in ys[1:]:
        acc = acc + y
    return acc


def _values(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Values whose sum depends on the order (magnitudes 1e-4 .. 1e4, both signs)."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-4, 5, shape, generator=g).double()
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    T=st.integers(1, 40),
    chunk=st.integers(1, 45),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    kind=st.sampled_from(["sum", "mean"]),
    strided=st.booleans(),
)
def test_chunks_sum_as_the_running_total(
    seed: int, T: int, chunk: int, dtype: torch.dtype, kind: str, strided: bool
) -> None:
    """Any chunking, any float dtype (narrow ones summed in float32), contiguous or not: the
    reducer's value is the running total's bitwise, and the chunks it read are unchanged."""
    ys = _values(seed, (T, 3, 5, 2) if strided else (T, 3, 5), dtype)
    chunks = [ys[t0 : t0 + chunk] for t0 in range(0, T, chunk)]
    if strided:
        chunks = [c[..., 0] for c in chunks]  # every other element: not contiguous
    before = [c.clone() for c in chunks]
    r = Reducer(kind, T)
    for i, c in enumerate(chunks):
        r.emit_chunk(i * chunk, [c])
    (got,) = r.outputs()
    wide = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    want = _running_total(torch.cat(chunks), wide)
    if kind == "mean":
        want = want / T
    assert got.dtype == dtype
    assert torch.equal(got, want.to(dtype))
    for c, b in zip(chunks, before, strict=True):
        assert torch.equal(c, b)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_and_boolean_outputs_sum_as_torch_adds_them(dtype: torch.dtype) -> None:
    """Integer outputs take the in-place path (torch's own adds); booleans, as ``a + y``
    does, stay boolean (logical or)."""
    ys = torch.randint(0, 3, (11, 4), generator=torch.Generator().manual_seed(1)).to(dtype)
    r = Reducer("sum", 11)
    r.emit_chunk(0, [ys[:4]])
    r.emit_chunk(4, [ys[4:]])
    (got,) = r.outputs()
    assert torch.equal(got, _running_total(ys, dtype))


def test_a_chunk_that_needs_gradients_is_summed_on_the_tape() -> None:
    """Outputs that need a gradient are not added into in place: the sum's gradient reaches
    them (each step's is the output gradient)."""
    ys = torch.randn(6, 3, requires_grad=True)
    r = Reducer("sum", 6)
    r.emit_chunk(0, [ys[:4]])
    r.emit_chunk(4, [ys[4:]])
    (got,) = r.outputs()
    grad = torch.randn(3)
    (g,) = torch.autograd.grad(got, ys, grad)
    assert torch.equal(g, grad.expand(6, 3))


def test_a_running_sum_begun_step_by_step_is_not_added_into() -> None:
    """A sum whose first value is a step's own output (`Reducer.emit`) is not changed in place
    by a later chunk: that output is left as it was."""
    ys = torch.randn(5, 4)
    first = ys[0].clone()
    r = Reducer("sum", 5)
    r.emit(0, [ys[0]])
    r.emit_chunk(1, [ys[1:]])
    (got,) = r.outputs()
    assert torch.equal(ys[0], first)
    assert torch.equal(got, _running_total(ys, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_add_steps_in_order_on_the_host(dtype: torch.dtype) -> None:
    """The compiled loop: ``acc + y_0 + y_1 ...`` rounded after each add (values where any
    other order rounds differently), an empty chunk a no-op."""
    acc = torch.tensor([1.0, -1.0, 3.0], dtype=dtype)
    big = 2.0**53 if dtype == torch.float64 else 2.0**24
    ys = torch.tensor([[big, 0.5, 1e-3], [1.0, 0.25, -3.0], [-big, -0.5, 1e-3]], dtype=dtype)
    want = acc.clone()
    for y in ys:
        want = want + y
    add_steps_in_order(acc, ys[:0])
    add_steps_in_order(acc, ys)
    assert torch.equal(acc, want)
    assert not torch.equal(want, torch.tensor([1.0, -1.0, 3.0], dtype=dtype) + ys.sum(0))
