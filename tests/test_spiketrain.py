"""SpikeTrain: packed time-first spike trains, exact round trips, per-step unpacking, COO."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from device_copies import HostToDeviceCopies
from hypothesis import given, settings
from hypothesis import strategies as st

from spikeckpt.engine.meter import MemoryMeter
from spikeckpt.errors import NotBinaryError
from spikeckpt.storage import SpikeTrain, as_spike_train
from spikeckpt.storage.codecs import BLOCK

DTYPES = [torch.bool, torch.uint8, torch.int16, torch.int64, torch.float16, torch.bfloat16]
DTYPES += [torch.float32, torch.float64]
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
# (T, B, ...) with odd sizes, zero sizes and 1-d trains.
shapes = st.lists(st.integers(0, 9), min_size=1, max_size=4).map(tuple)
codecs = st.sampled_from(["auto", "bitpack", "index"])


def _expected_nbytes(codec: str, shape: tuple[int, ...], ones: int) -> int:
    numel = 1
    for s in shape:
        numel *= s
    if codec == "bitpack":
        return (numel + 7) // 8
    n = 1
    for s in shape[1:]:
        n *= s
    per_step = -(-n // BLOCK)
    return 2 * ones + 8 * (shape[0] * per_step + 1)


@settings(max_examples=150, deadline=None)
@given(
    shape=shapes,
    density=densities,
    dtype=st.sampled_from(DTYPES),
    codec=codecs,
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_is_exact_with_the_smaller_codec(
    shape: tuple[int, ...], density: float, dtype: torch.dtype, codec: str, seed: int
) -> None:
    x = spikes(shape, density, dtype, seed)
    train = SpikeTrain.from_dense(x, codec)
    assert train.shape == x.shape and train.T == shape[0] == len(train)
    assert train.dtype == dtype and train.device == x.device
    assert train.ones == int(torch.count_nonzero(x))
    assert_bitwise_equal(train.dense(), x)
    assert train.nbytes == _expected_nbytes(train.codec, shape, train.ones)
    if codec == "auto":
        other = "index" if train.codec == "bitpack" else "bitpack"
        assert train.nbytes <= _expected_nbytes(other, shape, train.ones)
    else:
        assert train.codec == codec


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=4).map(tuple),
    density=densities,
    codec=codecs,
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_step_and_chunk_equal_dense_slices(
    shape: tuple[int, ...], density: float, codec: str, seed: int, data: st.DataObject
) -> None:
    x = spikes(shape, density, torch.float32, seed)
    train = SpikeTrain.from_dense(x, codec)
    T = shape[0]
    t = data.draw(st.integers(-T, T - 1))
    assert_bitwise_equal(train.step(t), x[t])
    a = data.draw(st.integers(0, T))
    b = data.draw(st.integers(a, T))
    assert_bitwise_equal(train.chunk(a, b), x[a:b])


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple),
    density=densities,
    codec=codecs,
    seed=st.integers(0, 2**31 - 1),
    slab=st.sampled_from([1, 3, 1 << 20]),
)
def test_step_ones_counts_each_step_s_ones(
    shape: tuple[int, ...], density: float, codec: str, seed: int, slab: int
) -> None:
    """Steps of any width (bit-packed steps start inside a byte), counted in slabs of any
    payload size, and a window of the train."""
    import spikeckpt.storage.spiketrain as module
    from spikeckpt.engine.inputs import TrainWindow

    x = spikes(shape, density, torch.float32, seed)
    train = SpikeTrain.from_dense(x, codec)
    expected = x.reshape(shape[0], -1).sum(dim=1).long()
    saved = module.ONES_SLAB_BYTES
    module.ONES_SLAB_BYTES = slab
    try:
        assert torch.equal(train.step_ones(), expected)
        assert torch.equal(TrainWindow(train, shape[0] // 2).step_ones(), expected[shape[0] // 2 :])
    finally:
        module.ONES_SLAB_BYTES = saved


@pytest.mark.parametrize("codec", ["bitpack", "index"])
def test_step_ones_of_steps_wider_than_an_index_block(codec: str) -> None:
    x = spikes((3, 1, BLOCK + 5), 0.3, torch.float32, 0)
    expected = x.reshape(3, -1).sum(dim=1).long()
    assert torch.equal(SpikeTrain.from_dense(x, codec).step_ones(), expected)


@pytest.mark.parametrize("width", [5, BLOCK + 5])
def test_one_index_train_unpacks_every_run_length_in_any_order(width: int) -> None:
    """An index train keeps each run length's block starts (a few at a time): one train asked
    for every chunk length, longest first and then shortest first, and steps between them,
    gives the dense slices each time."""
    T = 12
    x = spikes((T, 2, width), 0.01 if width > 5 else 0.3, torch.float32, seed=9)
    train = SpikeTrain.from_dense(x, "index")
    lengths = list(range(T, 0, -1)) + list(range(1, T + 1))
    for i, k in enumerate(lengths):
        a = i % (T - k + 1)
        assert_bitwise_equal(train.chunk(a, a + k), x[a : a + k])
        assert_bitwise_equal(train.step(i % T), x[i % T])


@pytest.mark.parametrize("codec", ["bitpack", "index"])
@pytest.mark.parametrize("density", [0.0, 0.01, 1.0])
def test_steps_wider_than_an_index_block(codec: str, density: float) -> None:
    x = spikes((3, 2, BLOCK + 5), density, torch.bool, seed=3)
    train = SpikeTrain.from_dense(x, codec)
    for t in range(3):
        assert_bitwise_equal(train.step(t), x[t])
    assert_bitwise_equal(train.chunk(1, 3), x[1:3])
    assert_bitwise_equal(train.dense(), x)
    assert_bitwise_equal(train.to_dense(), x)  # torch's name for it


def test_auto_prefers_index_lists_for_sparse_trains_and_bitpack_for_dense_ones() -> None:
    sparse = SpikeTrain.from_dense(spikes((100, 8, 700), 0.01, torch.float32, 0))
    dense = SpikeTrain.from_dense(spikes((100, 8, 700), 0.2, torch.float32, 0))
    assert sparse.codec == "index" and dense.codec == "bitpack"
    assert dense.nbytes * 8 == dense.numel  # 1 bit per element
    assert sparse.nbytes < dense.nbytes
    assert dense.dense_nbytes == 32 * dense.nbytes


# ------------------------------------------------------------------------------ sparse COO


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes,
    density=densities,
    dtype=st.sampled_from(DTYPES),
    codec=codecs,
    seed=st.integers(0, 2**31 - 1),
)
def test_sparse_coo_round_trip_is_exact(
    shape: tuple[int, ...], density: float, dtype: torch.dtype, codec: str, seed: int
) -> None:
    x = spikes(shape, density, dtype, seed)
    train = SpikeTrain.from_dense(x, codec)
    coo = train.to_sparse_coo()
    assert coo.layout == torch.sparse_coo and coo.is_coalesced()
    assert coo.shape == x.shape and coo.dtype == dtype and coo._nnz() == train.ones
    assert_bitwise_equal(coo.to_dense(), x)
    back = SpikeTrain.from_sparse_coo(coo, codec)
    assert_bitwise_equal(back.dense(), x)
    assert_bitwise_equal(as_spike_train(coo).dense(), x)


def test_from_sparse_coo_accepts_uncoalesced_input_and_explicit_zeros() -> None:
    indices = torch.tensor([[3, 0, 1, 0], [1, 2, 0, 0]])
    values = torch.tensor([1.0, 1.0, 0.0, 1.0])
    coo = torch.sparse_coo_tensor(indices, values, (4, 3), check_invariants=True)
    train = SpikeTrain.from_sparse_coo(coo)
    assert train.ones == 3
    assert torch.equal(train.dense(), coo.to_dense())
    assert torch.equal(train.step(3), torch.tensor([0.0, 1.0, 0.0]))


def test_from_sparse_coo_refuses_repeats_and_non_binary_values() -> None:
    repeated = torch.sparse_coo_tensor(
        torch.tensor([[0, 0], [1, 1]]), torch.ones(2), (2, 2), check_invariants=True
    )
    with pytest.raises(NotBinaryError, match=r"is 2\.0"):
        SpikeTrain.from_sparse_coo(repeated)
    half = torch.sparse_coo_tensor(
        torch.tensor([[1], [0]]), torch.tensor([0.5]), (2, 2), check_invariants=True
    )
    with pytest.raises(NotBinaryError, match=r"0\.5"):
        SpikeTrain.from_sparse_coo(half)
    hybrid = torch.sparse_coo_tensor(
        torch.tensor([[0]]), torch.ones(1, 3), (2, 3), check_invariants=True
    )
    with pytest.raises(ValueError, match="hybrid"):
        SpikeTrain.from_sparse_coo(hybrid)
    with pytest.raises(TypeError, match="sparse_coo"):
        SpikeTrain.from_sparse_coo(torch.ones(2, 2))


# ------------------------------------------------------------------------------ errors


def test_from_dense_names_the_value_that_is_not_a_spike() -> None:
    x = torch.zeros(5, 2, 3)
    x[2, 1, 0] = 2.0
    with pytest.raises(NotBinaryError, match=r"is 2\.0") as info:
        SpikeTrain.from_dense(x)
    assert "spike train" in str(info.value) and "threshold" in str(info.value)
    negative_zero = torch.zeros(4, 2)
    negative_zero[1, 1] = -0.0
    with pytest.raises(NotBinaryError, match="negative zero"):
        SpikeTrain.from_dense(negative_zero)
    with pytest.raises(NotBinaryError, match="complex"):
        SpikeTrain.from_dense(torch.zeros(3, 2, dtype=torch.complex64))


def test_wrong_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="time axis"):
        SpikeTrain.from_dense(torch.tensor(1.0))
    with pytest.raises(TypeError, match="from_sparse_coo"):
        SpikeTrain.from_dense(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match="torch.Tensor"):
        SpikeTrain.from_dense([[0, 1]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown spike-train codec 'dense'"):
        SpikeTrain.from_dense(torch.zeros(2, 2), codec="dense")
    train = SpikeTrain.from_dense(torch.zeros(4, 2))
    with pytest.raises(IndexError, match="step 4 is out of range .* T=4"):
        train.step(4)
    with pytest.raises(IndexError, match="0 <= a <= b <= T"):
        train.chunk(3, 2)
    with pytest.raises(IndexError, match="0 <= a <= b <= T"):
        train.chunk(0, 5)


def test_from_indices_checks_its_positions() -> None:
    train = SpikeTrain.from_indices(torch.tensor([0, 5, 11]), (3, 4), torch.float32)
    expected = torch.zeros(12)
    expected[[0, 5, 11]] = 1
    assert torch.equal(train.dense(), expected.reshape(3, 4))
    with pytest.raises(ValueError, match=r"\[0, 12\)"):
        SpikeTrain.from_indices(torch.tensor([0, 12]), (3, 4))
    with pytest.raises(ValueError, match="strictly increasing"):
        SpikeTrain.from_indices(torch.tensor([5, 5]), (3, 4))
    with pytest.raises(ValueError, match="strictly increasing"):
        SpikeTrain.from_indices(torch.tensor([6, 5]), (3, 4))
    with pytest.raises(ValueError, match="cannot hold packed spikes"):
        SpikeTrain.from_indices(torch.tensor([1]), (3, 4), torch.complex64)
    # float positions were truncated silently (0.7 -> 0); a bool mask read as positions 0 and 1
    with pytest.raises(TypeError, match=r"integer tensor of flat indices, got torch\.float32"):
        SpikeTrain.from_indices(torch.tensor([0.7, 3.2]), (3, 4))
    mask = torch.zeros(12, dtype=torch.bool)
    mask[[0, 5]] = True
    with pytest.raises(TypeError, match=r"got torch\.bool.*from_dense\(mask"):
        SpikeTrain.from_indices(mask, (3, 4))
    assert torch.equal(
        SpikeTrain.from_indices(torch.tensor([0, 5], dtype=torch.int32), (3, 4)).dense(),
        mask.reshape(3, 4).float(),
    )


# ------------------------------------------------------------------------------ cost, moving, pickling


@pytest.mark.parametrize("codec", ["bitpack", "index"])
def test_a_step_costs_memory_for_one_step_not_for_the_train(codec: str) -> None:
    T, B, C = 2000, 4, 96
    train = SpikeTrain.from_dense(spikes((T, B, C), 0.05, torch.float32, 1), codec)
    one_step = B * C * 4
    with MemoryMeter() as meter:
        y = train.step(1234)
    assert y.shape == (B, C)
    assert meter.peak_bytes <= 4 * one_step + 4096, (meter.peak_bytes, one_step)
    with MemoryMeter() as meter:
        train.chunk(100, 110)
    assert meter.peak_bytes <= 4 * 10 * one_step + 4096


def test_to_moves_only_the_payload_and_keeps_the_type() -> None:
    train = SpikeTrain.from_dense(spikes((6, 3, 5), 0.3, torch.float32, 2))
    assert train.to("cpu") is train and train.cpu() is train
    meta = train.to("meta")
    assert isinstance(meta, SpikeTrain) and meta.device.type == "meta"
    assert meta.nbytes == train.nbytes and meta.shape == train.shape


@pytest.mark.parametrize("codec", ["bitpack", "index"])
def test_steps_of_a_device_train_copy_nothing_from_the_host_per_step(codec: str) -> None:
    """An index train's offsets live on the host; a step's bounds are read there, and its
    counts come from a copy of the offsets made once per device. (A copy per step from
    pageable host memory makes the host wait for the GPU's queue: one sync per step. The
    "meta" device stands in for a GPU here.)"""
    x = spikes((20, 4, 300), 0.05, torch.float32, 6)
    train = SpikeTrain.from_dense(x, codec).to("meta")
    with HostToDeviceCopies() as copies:
        for t in range(10):
            assert train.step(t).device.type == "meta"
        train.chunk(3, 17)
    assert copies.count <= 1, copies.count  # the offsets, once


@pytest.mark.parametrize("codec", ["bitpack", "index"])
def test_pickle_and_torch_save_keep_the_train(codec: str) -> None:
    x = spikes((7, 3, 5), 0.2, torch.float16, 4)
    train = SpikeTrain.from_dense(x, codec)
    assert_bitwise_equal(pickle.loads(pickle.dumps(train)).dense(), x)
    buffer = io.BytesIO()
    torch.save({"x": train}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True by default: the class is allowlisted
    assert isinstance(loaded["x"], SpikeTrain) and loaded["x"].codec == codec
    assert_bitwise_equal(loaded["x"].dense(), x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", ["bitpack", "index"])
def test_cuda_unpacks_on_the_device_from_a_pinned_host_train(codec: str) -> None:
    x = spikes((50, 4, 300), 0.03, torch.float32, 5)
    host = SpikeTrain.from_dense(x, codec).pin_memory()
    assert host.is_pinned()
    assert_bitwise_equal(host.step(7, "cuda").cpu(), x[7])
    assert_bitwise_equal(host.chunk(3, 40, "cuda").cpu(), x[3:40])
    gpu = host.to("cuda")
    assert gpu.device.type == "cuda" and gpu.nbytes == host.nbytes
    assert_bitwise_equal(gpu.step(-1).cpu(), x[-1])
    assert_bitwise_equal(gpu.to_sparse_coo().to_dense().cpu(), x)
    assert_bitwise_equal(SpikeTrain.from_dense(x.cuda(), codec).dense().cpu(), x)
