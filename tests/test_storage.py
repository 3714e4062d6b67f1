"""Spike codecs (dense, bitpack, index) and the saved-tensor hooks that pack spikes."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spikeckpt.errors import NotBinaryError
from spikeckpt.storage import codecs
from spikeckpt.storage.codecs import BLOCK, Packed, is_binary, pack, require_binary, unpack
from spikeckpt.storage.hooks import SavedStats, packed_saved_tensors

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
_BITS[torch.float64] = torch.int64


def spikes(shape: tuple[int, ...], density: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen) < density).to(dtype)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    view = _BITS.get(a.dtype)
    if view is not None:
        a, b = a.contiguous().view(view), b.contiguous().view(view)
    assert torch.equal(a, b)


densities = st.one_of(st.sampled_from([0.0, 1.0, 1 / 16, 1 / 32]), st.floats(0.0, 1.0))
shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple)


# ---------------------------------------------------------------------------------- round trips


@settings(max_examples=150, deadline=None)
@given(
    shape=shapes,
    density=densities,
    dtype=st.sampled_from(DTYPES),
    codec=st.sampled_from(["auto", "bitpack", "index", "dense"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_is_exact(
    shape: tuple[int, ...], density: float, dtype: torch.dtype, codec: str, seed: int
) -> None:
    x = spikes(shape, density, dtype, seed)
    packed = pack(x, codec)
    assert packed.codec == (codec if codec != "auto" else packed.codec)
    assert packed.codec in ("bitpack", "index", "dense")
    assert packed.nbytes == sum(p.numel() * p.element_size() for p in packed.payload)
    assert_bitwise_equal(unpack(packed), x)


@settings(max_examples=12, deadline=None)
@given(
    numel=st.integers(BLOCK + 1, 3 * BLOCK + 17),
    density=st.sampled_from([0.0, 1e-4, 0.01, 0.05, 0.5, 1.0]),
    dtype=st.sampled_from([torch.bool, torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_of_index_lists_over_several_blocks(
    numel: int, density: float, dtype: torch.dtype, seed: int
) -> None:
    x = spikes((numel,), density, dtype, seed).reshape(1, numel)
    packed = pack(x, "index")
    local, counts = packed.payload
    assert local.dtype == torch.int16 and counts.dtype == torch.int32
    assert counts.numel() == -(-numel // BLOCK)
    assert int(counts.sum()) == int(x.count_nonzero())
    assert_bitwise_equal(unpack(packed), x)


@settings(max_examples=80, deadline=None)
@given(
    numel=st.one_of(st.integers(0, 300), st.integers(BLOCK - 3, BLOCK + 40)),
    density=densities,
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
    spoil=st.sampled_from([None, 2.0, -0.0, float("nan"), 0.5]),
    compiled=st.booleans(),
)
def test_the_compiled_scans_count_as_numpy_does(
    numel: int,
    density: float,
    dtype: torch.dtype,
    seed: int,
    spoil: float | None,
    compiled: bool,
) -> None:
    """`count_binary` (one pass, no mask) gives the count of non-zeros and the binary test
    as torch does; `_scan_numpy`'s compiled pass the mask and count of its NumPy passes
    (``-0.0``, NaN, 2 and 0.5 make a tensor not binary)."""
    from spikeckpt.storage import scan_jit

    x = spikes((numel,), density, dtype, seed)
    if spoil is not None and numel and dtype.is_floating_point:
        x[seed % numel] = spoil
    with pytest.MonkeyPatch.context() as patch:
        if compiled:
            assert scan_jit.ones_masked is not None and scan_jit.bits_counted is not None
        else:
            patch.setattr(scan_jit, "ones_masked", None)
            patch.setattr(scan_jit, "bits_counted", None)
        counted = codecs.count_binary(x)
        found = codecs._scan_numpy(x)
    patch_free = codecs._scan_torch(x)
    assert counted == (int(torch.count_nonzero(x)), patch_free is not None)
    assert (found is None) == (patch_free is None)
    if found is not None and patch_free is not None:
        assert found[1] == patch_free[1] and torch.equal(found[0], patch_free[0])


@settings(max_examples=80, deadline=None)
@given(
    numel=st.one_of(st.integers(0, 300), st.integers(BLOCK - 3, 2 * BLOCK + 40)),
    density=densities,
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
    spoil=st.sampled_from([None, 2.0, -0.0]),
)
def test_cpu_numpy_codec_is_bitwise_the_torch_codec_of_other_devices(
    numel: int, density: float, dtype: torch.dtype, seed: int, spoil: float | None
) -> None:
    # CPU tensors are coded with numpy, every other device with torch ops: run both here.
    x = spikes((numel,), density, dtype, seed)
    if spoil is not None and numel and dtype.is_floating_point:
        x[seed % numel] = spoil
        assert codecs._scan_numpy(x) is None and codecs._scan_torch(x) is None
        return
    found, expected = codecs._scan_numpy(x), codecs._scan_torch(x)
    assert found is not None and expected is not None
    assert found[1] == expected[1] and torch.equal(found[0], expected[0])
    mask = found[0]
    bits = codecs._bitpack_numpy(mask)
    assert torch.equal(bits, codecs._bitpack_torch(mask))
    index = codecs._index_encode_numpy(mask)
    expected_index = codecs._index_encode_torch(mask)
    for a, b in zip(index, expected_index, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for out in (dtype, torch.bool, torch.bfloat16):
        assert_bitwise_equal(
            codecs._bitunpack_numpy(bits, numel, out), codecs._bitunpack_torch(bits, numel, out)
        )
        assert_bitwise_equal(
            codecs._index_decode_numpy(index, numel, out),
            codecs._index_decode_torch(index, numel, out),
        )
    assert_bitwise_equal(codecs._bitunpack_numpy(bits, numel, dtype), x)


def test_cpu_bit_unpacking_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codecs, "_UNPACK_BYTES", 3)  # 24 elements per numpy call
    for numel in (0, 1, 23, 24, 25, 48, 100):
        x = spikes((numel,), 0.5, torch.float32, numel)
        packed = pack(x, "bitpack")
        assert_bitwise_equal(unpack(packed), x)
        # bytes past the last element (a slice of a longer train) are ignored, as on devices
        longer = torch.cat([packed.payload[0], torch.full((7,), 255, dtype=torch.uint8)])
        assert_bitwise_equal(
            codecs._bitunpack_numpy(longer, numel, torch.float32),
            codecs._bitunpack_torch(longer, numel, torch.float32),
        )


def test_index_positions_use_the_whole_int16_range() -> None:
    x = torch.zeros(BLOCK)
    x[[0, 32767, 32768, BLOCK - 1]] = 1
    packed = pack(x, "index")
    assert packed.payload[0].tolist() == [-32768, -1, 0, 32767]
    assert len(packed.payload) == 1
    assert_bitwise_equal(unpack(packed), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_non_binary_floats_are_stored_dense_bit_for_bit(dtype: torch.dtype) -> None:
    x = torch.tensor([0.0, -0.0, 1.0, float("nan"), float("inf"), 0.5, -1.0], dtype=dtype)
    for case in (x, x[:2], x[3:4], torch.tensor([0.0, 1.0, -0.0], dtype=dtype)):
        packed = pack(case)
        assert packed.codec == "dense"
        assert_bitwise_equal(unpack(packed), case)


def test_negative_zero_is_not_binary() -> None:
    assert is_binary(torch.tensor([0.0, 1.0]))
    assert not is_binary(torch.tensor([-0.0, 1.0]))
    with pytest.raises(NotBinaryError, match="negative zero"):
        pack(torch.tensor([-0.0, 1.0]), "bitpack")


def test_is_binary_by_dtype_and_layout() -> None:
    assert is_binary(torch.tensor([True, False]))
    assert is_binary(torch.tensor([0, 1, 1], dtype=torch.int64))
    assert not is_binary(torch.tensor([0, 2], dtype=torch.uint8))
    assert not is_binary(torch.tensor([0, -1], dtype=torch.int8))
    assert not is_binary(torch.tensor([0.0, float("nan")]))
    assert not is_binary(torch.tensor([0, 1], dtype=torch.complex64))
    assert not is_binary(torch.eye(3).to_sparse())
    assert is_binary(torch.empty(0, 5))
    assert is_binary(torch.tensor(1.0))
    big = torch.ones(10_000)
    big[-1] = 2.0  # the cheap check of the first elements passes, the full check does not
    assert not is_binary(big)


def test_layout_details_survive() -> None:
    x = spikes((6, 40), 0.3, torch.float32, 1)
    for case in (x.t(), x[:, ::3], torch.tensor(1.0), torch.empty(3, 0, 2), x[2]):
        for codec in ("auto", "bitpack", "index"):
            out = unpack(pack(case, codec))
            assert out.is_contiguous()
            assert_bitwise_equal(out, case.contiguous())


def test_pack_detaches_and_unpack_moves() -> None:
    x = spikes((8, 8), 0.5, torch.float32, 2).requires_grad_()
    packed = pack(x)
    assert not any(p.requires_grad for p in packed.payload)
    out = unpack(packed, device="cpu")
    assert not out.requires_grad and torch.equal(out, x.detach())
    moved = packed.to("cpu")
    assert isinstance(moved, Packed) and moved.device == packed.device


def test_dense_codec_keeps_a_reference() -> None:
    x = torch.randn(4, 5)
    packed = pack(x, "dense")
    assert packed.payload[0].data_ptr() == x.data_ptr()
    assert packed.nbytes == packed.dense_nbytes == 80


def test_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="'auto', 'dense', 'bitpack', 'index'"):
        pack(torch.zeros(3), "zip")
    with pytest.raises(NotBinaryError) as info:
        pack(torch.tensor([0.0, 0.5, 1.0, 3.0]), "index")
    message = str(info.value)
    assert "'index'" in message and "2 of 4" in message and "0.5" in message
    assert "threshold" in message
    with pytest.raises(NotBinaryError, match="complex64"):
        pack(torch.zeros(2, dtype=torch.complex64), "bitpack")


def test_require_binary_names_the_tensor_the_value_and_the_fix() -> None:
    x = torch.zeros(3, 4)
    assert require_binary(x, "inputs") is x
    x[1, 2] = 0.25
    with pytest.raises(NotBinaryError) as info:
        require_binary(x, "inputs")
    message = str(info.value)
    assert "inputs" in message and "(3, 4)" in message and "0.25" in message
    assert "flat index 6" in message and "(x > 0)" in message
    with pytest.raises(NotBinaryError, match=r"x \+ 0\.0"):
        require_binary(torch.tensor([-0.0]), "spikes")


# ------------------------------------------------------------------------------- codec choice


@pytest.mark.parametrize("numel", [16 * 64, BLOCK, 2 * BLOCK])
def test_auto_picks_index_lists_below_the_break_even_density(numel: int) -> None:
    bitpack_bytes = numel // 8
    blocks = 0 if numel <= BLOCK else numel // BLOCK
    tie = (bitpack_bytes - 4 * blocks) // 2  # ones at which both take the same bytes
    for ones, codec in ((tie, "bitpack"), (tie - 1, "index"), (tie + 1, "bitpack")):
        x = torch.zeros(numel)
        x[torch.randperm(numel)[:ones]] = 1
        packed = pack(x)
        assert packed.codec == codec, (numel, ones)
        assert packed.nbytes <= bitpack_bytes
        assert_bitwise_equal(unpack(packed), x)
    # About 1/16 density: 16-bit positions.
    assert abs(tie / numel - 1 / 16) < 1e-3


def test_all_zero_tensors_take_no_bytes() -> None:
    packed = pack(torch.zeros(10, 100))
    assert packed.codec == "index" and packed.nbytes == 0
    assert_bitwise_equal(unpack(packed), torch.zeros(10, 100))


def test_sizes_at_five_percent_density() -> None:
    x = spikes((32, 700, 100), 0.05, torch.float32, 3)
    dense = x.numel() * 4
    for codec in ("bitpack", "index", "auto"):
        packed = pack(x, codec)
        assert packed.nbytes <= dense / 30, codec
    assert pack(x, "bitpack").nbytes == x.numel() // 8
    assert pack(x).codec == "index"  # 16 bits * 5% = 0.8 bits per element < 1


@pytest.mark.slow
def test_bitpack_is_vectorised() -> None:
    x = spikes((32, 700, 1000), 0.05, torch.float32, 4)
    start = time.perf_counter()
    packed = pack(x, "bitpack")
    out = unpack(packed)
    elapsed = time.perf_counter() - start
    assert torch.equal(out, x)
    assert elapsed < 5.0  # about 0.1-0.2 s here; a Python loop would take minutes


# -------------------------------------------------------------------------------------- hooks


def lif_loss(
    w_in: torch.nn.Linear, w_out: torch.nn.Linear, beta: torch.Tensor, inputs: torch.Tensor
) -> torch.Tensor:
    """A 2-layer LIF net with a fast-sigmoid surrogate; inputs (T, B, N) spikes."""

    class Spike(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):  # type: ignore[no-untyped-def, override]
            ctx.save_for_backward(v)
            return (v > 0).to(v.dtype)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
            (v,) = ctx.saved_tensors
            return grad / (1 + 10 * v.abs()) ** 2

    v = torch.zeros(inputs.shape[1], w_in.out_features)
    total = torch.zeros(())
    for x_t in inputs:
        v = beta * v + w_in(x_t)
        s = Spike.apply(v - 1.0)
        v = v - s
        total = total + w_out(s).square().mean()
    return total


def test_hooks_pack_spikes_and_leave_gradients_bitwise_equal() -> None:
    torch.manual_seed(0)
    w_in, w_out = torch.nn.Linear(200, 128), torch.nn.Linear(128, 10)
    beta = torch.tensor(0.9, requires_grad=True)
    inputs = spikes((12, 16, 200), 0.1, torch.float32, 5).requires_grad_()
    params = [*w_in.parameters(), *w_out.parameters(), beta, inputs]

    grads_plain = torch.autograd.grad(lif_loss(w_in, w_out, beta, inputs), params)
    with packed_saved_tensors() as stats:
        loss = lif_loss(w_in, w_out, beta, inputs)
    grads_packed = torch.autograd.grad(loss, params)  # backward after the block: still unpacks

    for a, b in zip(grads_plain, grads_packed, strict=True):
        assert_bitwise_equal(a, b)
    assert isinstance(stats, SavedStats)
    # Packed: 12 input slices (16 x 200) for w_in, 12 spike tensors (16 x 128) for w_out.
    assert stats.packed_count >= 24
    assert stats.stored_bytes < stats.saved_bytes
    spikes_dense = 12 * (16 * 200 + 16 * 128) * 4
    assert stats.spared_bytes > 0.9 * spikes_dense


def test_hooks_leave_small_and_non_binary_tensors_alone() -> None:
    w = torch.nn.Linear(64, 8)
    small = spikes((4, 64), 0.5, torch.float32, 6)  # 256 elements < min_numel
    real = torch.randn(64, 64)
    with packed_saved_tensors(min_numel=1024) as stats:
        loss = w(small).sum() + w(real).sum()
    loss.backward()
    assert stats.saved_count > 0 and stats.packed_count == 0
    assert stats.stored_bytes == stats.saved_bytes
    with packed_saved_tensors(min_numel=1) as stats:
        w(small).sum().backward()
    assert stats.packed_count == 1
