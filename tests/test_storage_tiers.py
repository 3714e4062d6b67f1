"""Storage tiers (device, host, disk): round trips, ledger counts, files, cleanup, errors."""

from __future__ import annotations

import errno
import gc
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spikeckpt.errors import StorageError
from spikeckpt.storage import disk as disk_module
from spikeckpt.storage.base import Ledger, StateStore
from spikeckpt.storage.codecs import pack
from spikeckpt.storage.tiers import DeviceStore, DiskStore, HostStore, make_store

KINDS = ["device", "host", "disk"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def state(seed: int = 0) -> list[torch.Tensor]:
    """A mixed checkpoint: spikes (float, bool), membrane, counters, a view, empty and 0-d."""
    gen = torch.Generator().manual_seed(seed)
    spikes = (torch.rand(32, 700, generator=gen) < 0.05).float()
    membrane = torch.randn(32, 256, generator=gen)
    return [
        spikes,
        spikes.bool(),
        membrane,
        torch.arange(7),
        membrane.t()[:5],
        torch.empty(0, 3),
        torch.tensor(-0.0),
    ]


def expected_bytes(kind: str, tensors: list[torch.Tensor]) -> int:
    if kind == "device":
        return sum(t.numel() * t.element_size() for t in tensors)
    return sum(pack(t).nbytes for t in tensors)


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert torch.equal(a, b)
        if b.is_floating_point():
            assert torch.equal(torch.signbit(a), torch.signbit(b))


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    directory = tmp_path if request.param == "disk" else None
    made = make_store(request.param, "cpu", Ledger(), directory=directory)
    yield made
    made.close()


def test_put_get_prefetch_drop_close(store: StateStore) -> None:
    assert isinstance(store, StateStore)
    first, second = state(0), state(1)
    store.put(0, first)
    store.put(5, second)
    store.prefetch(5)
    assert_same(store.get(5), second)
    assert_same(store.get(0), first)
    assert_same(store.get(0), first)  # a key can be read again until dropped
    store.drop(0)
    store.drop(0)  # unknown keys: no-op
    with pytest.raises(KeyError, match="no checkpoint 0 in the"):
        store.get(0)
    with pytest.raises(KeyError):
        store.prefetch(0)
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.put(1, first)


def test_ledger_counts_bytes_held_and_moved(store: StateStore) -> None:
    ledger: Ledger = store.ledger  # type: ignore[attr-defined]
    kind = store.kind
    a, b = state(0), state(1)
    na, nb = expected_bytes(kind, a), expected_bytes(kind, b)
    store.put(0, a)
    store.put(1, b)
    assert ledger.current[kind] == ledger.peak[kind] == na + nb
    store.put(1, b)  # replacing a key does not count it twice
    assert ledger.current[kind] == na + nb
    store.get(1)
    store.drop(0)
    assert ledger.current[kind] == nb and ledger.peak[kind] == na + nb
    if kind == "device":
        assert ledger.written.get(kind, 0) == ledger.read.get(kind, 0) == 0
    else:
        assert ledger.written[kind] == na + 2 * nb
        assert ledger.read[kind] == nb
    store.close()
    assert ledger.current[kind] == 0


def test_packed_tiers_hold_spikes_in_a_thirtieth_of_the_dense_bytes(store: StateStore) -> None:
    spikes = (torch.rand(64, 32, 700) < 0.05).float()
    store.put(0, [spikes])
    held = store.ledger.current[store.kind]  # type: ignore[attr-defined]
    dense = spikes.numel() * 4
    assert held == dense if store.kind == "device" else held <= dense / 30
    assert torch.equal(store.get(0)[0], spikes)


def test_device_tier_keeps_references() -> None:
    store = DeviceStore("cpu", Ledger())
    x = torch.randn(3)
    store.put(0, [x])
    assert store.get(0)[0] is x


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_copying_tiers_do_not_share_memory_with_the_input(kind: str, tmp_path: Path) -> None:
    store = make_store(kind, "cpu", Ledger(), directory=tmp_path if kind == "disk" else None)
    x = torch.randn(100)
    store.put(0, [x])
    if kind == "disk":
        store.flush()  # type: ignore[attr-defined]
    x.add_(1.0)
    assert not torch.equal(store.get(0)[0], x)
    store.close()


def test_make_store_errors() -> None:
    with pytest.raises(ValueError, match="'device', 'host', 'disk'"):
        make_store("gpu", "cpu", Ledger())
    with pytest.raises(ValueError, match="only applies to storage='disk'"):
        make_store("host", "cpu", Ledger(), directory="/tmp")
    assert isinstance(make_store("host", "cpu", Ledger()), HostStore)


# ---------------------------------------------------------------------------------- disk tier


def test_disk_checkpoints_share_one_file_whose_freed_regions_are_reused(tmp_path: Path) -> None:
    store = DiskStore("cpu", Ledger(), directory=tmp_path)
    folder = Path(store.directory)
    assert folder.parent == tmp_path and folder.name.startswith("spikeckpt-")
    assert Path(store.path) == folder / disk_module.FILE_NAME
    store.put(0, state(0))
    store.put(1, state(1))
    assert [p.name for p in folder.iterdir()] == [disk_module.FILE_NAME]
    two = store.file_bytes()
    assert two >= 2 * expected_bytes("disk", state(0))
    store.drop(0)
    store.put(2, state(2))  # into the region checkpoint 0 left: the file does not grow
    assert store.file_bytes() == two
    assert [p.name for p in folder.iterdir()] == [disk_module.FILE_NAME]
    assert_same(store.get(2), state(2))
    assert_same(store.get(1), state(1))
    store.close()
    assert not folder.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("background_bytes", [0, disk_module.BACKGROUND_BYTES])
def test_disk_prefetch_reads_ahead_in_the_background(tmp_path: Path, background_bytes: int) -> None:
    store = DiskStore("cpu", Ledger(), directory=tmp_path, background_bytes=background_bytes)
    checkpoints = {k: state(k) for k in range(4)}
    for k, tensors in checkpoints.items():
        store.put(k, tensors)
    for k in reversed(range(4)):  # backward order, one ahead, dropping as it goes
        if k > 0:
            store.prefetch(k - 1)
        assert_same(store.get(k), checkpoints[k])
        store.drop(k)
    store.flush()
    assert len(store) == 0
    store.close()


def _sized_state(seed: int, size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(size, generator=gen) < 0.3).float(), torch.randn(size, generator=gen)]


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "prefetch", "drop"]),
            st.integers(0, 5),
            st.integers(0, 3000),
        ),
        min_size=1,
        max_size=40,
    ),
    background_bytes=st.sampled_from([0, 4000, disk_module.BACKGROUND_BYTES]),
)
def test_disk_store_keeps_every_checkpoint_whatever_the_order_and_sizes(
    ops: list[tuple[str, int, int]], background_bytes: int
) -> None:
    # Regions of the one file are freed and reused while background writes and reads may
    # still run: every checkpoint read back must be the one written, and no two live
    # checkpoints may share bytes of the file.
    with tempfile.TemporaryDirectory() as folder:
        store = DiskStore("cpu", Ledger(), directory=folder, background_bytes=background_bytes)
        held: dict[int, list[torch.Tensor]] = {}
        for i, (op, key, size) in enumerate(ops):
            if op == "put":
                held[key] = _sized_state(i, size)
                store.put(key, held[key])
            elif op == "drop":
                held.pop(key, None)
                store.drop(key)
            elif key in held:
                if op == "get":
                    assert_same(store.get(key), held[key])
                else:
                    store.prefetch(key)
            spans = sorted(
                (item.offset, item.offset + item.capacity) for item in store._items.values()
            )
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        for key, tensors in held.items():
            assert_same(store.get(key), tensors)
        store.close()
        assert os.listdir(folder) == []


def test_disk_folder_removed_when_the_store_is_garbage_collected(tmp_path: Path) -> None:
    store = DiskStore("cpu", Ledger(), directory=tmp_path)
    folder = Path(store.directory)
    store.put(0, state(0))
    del store
    gc.collect()
    assert not folder.exists()


def test_disk_default_folder_is_a_fresh_temporary_folder() -> None:
    store = DiskStore("cpu", Ledger())
    folder = Path(store.directory)
    assert folder.is_dir() and folder.name.startswith("spikeckpt-")
    store.close()
    assert not folder.exists()


def test_unwritable_directory_raises_storage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError) as info:
        DiskStore("cpu", Ledger(), directory=blocker / "checkpoints")
    message = str(info.value)
    assert str(blocker / "checkpoints") in message
    assert "directory=" in message and "storage='host'" in message
    assert isinstance(info.value, OSError)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write anywhere"
)
def test_read_only_directory_raises_storage_error(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(StorageError, match="not writable"):
            DiskStore("cpu", Ledger(), directory=tmp_path)
    finally:
        tmp_path.chmod(0o700)


@pytest.mark.parametrize("background", [False, True], ids=["calling-thread", "io-thread"])
def test_full_disk_raises_storage_error_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    calls = []
    write_at = disk_module._write_at

    def full_after_one(fd: int, views: list[memoryview], offset: int) -> None:
        calls.append(1)
        if len(calls) > 1:
            os.pwrite(fd, b"partial", offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        write_at(fd, views, offset)

    monkeypatch.setattr(disk_module, "_write_at", full_after_one)
    ledger = Ledger()
    store = DiskStore(
        "cpu", ledger, directory=tmp_path, background_bytes=0 if background else 1 << 20
    )
    folder = Path(store.directory)
    store.put(0, state(0))
    if background:
        store.put(1, state(1))  # fails in the background thread
        deadline = time.monotonic() + 10
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        with pytest.raises(StorageError) as info:
            store.get(0)  # the next call surfaces it
    else:
        with pytest.raises(StorageError) as info:
            store.put(1, state(1))  # the call that wrote
    error = info.value
    assert error.errno == errno.ENOSPC
    message = str(error)
    assert "disk is full" in message and str(folder) in message
    assert "needed:" in message and "storage='host'" in message
    assert not folder.exists()  # the store removed its file and folder
    assert ledger.current["disk"] == 0
    with pytest.raises(StorageError):
        store.put(2, state(2))  # and stays failed
    store.close()


def test_disk_forgets_finished_writes_but_not_failed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every store call checks for failed writes; that check must not scan all writes so far
    # (it made a 4000-step TwoLevel run quadratic): finished writes are forgotten.
    store = DiskStore("cpu", Ledger(), directory=tmp_path, background_bytes=0)
    for k in range(200):
        store.put(k, state(k))
    store.flush()
    assert store._writes == {} and store._failed == []
    store.close()

    def fail(fd: int, views: list[memoryview], offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module, "_write_at", fail)
    store = DiskStore("cpu", Ledger(), directory=tmp_path, background_bytes=0)
    store.put(0, state(0))
    store.drop(0)  # dropped before anyone looked: the failure is still reported
    deadline = time.monotonic() + 10
    while not store._failed and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(StorageError, match="disk is full"):
        store.put(1, state(1))
    store.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("background_bytes", [0, disk_module.BACKGROUND_BYTES])
def test_read_errors_raise_storage_error(tmp_path: Path, background_bytes: int) -> None:
    store = DiskStore("cpu", Ledger(), directory=tmp_path, background_bytes=background_bytes)
    store.put(0, state(0))
    store.flush()
    os.truncate(store.path, 0)  # someone cut the file short
    with pytest.raises(StorageError, match="read a checkpoint file"):
        store.get(0)
    assert not Path(store.directory).exists()
    store.close()


# ---------------------------------------------------------------------------------- CUDA paths


@cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_round_trip(kind: str, tmp_path: Path) -> None:
    device = torch.device("cuda")
    store = make_store(kind, device, Ledger(), directory=tmp_path if kind == "disk" else None)
    checkpoints = {k: [t.to(device) for t in state(k)] for k in range(3)}
    for k, tensors in checkpoints.items():
        store.put(k, tensors)
    for k in reversed(range(3)):
        if k > 0:
            store.prefetch(k - 1)
        got = store.get(k)
        assert all(t.device.type == "cuda" for t in got)
        assert_same(got, checkpoints[k])
        store.drop(k)
    store.close()


@cuda
def test_cuda_host_tier_reuses_pinned_buffers_and_overlaps() -> None:
    store = HostStore("cuda", Ledger())
    assert store.pin_memory
    x = (torch.rand(256, 1024, device="cuda") < 0.3).float()
    m = torch.randn(256, 1024, device="cuda")
    for _ in range(3):  # same sizes every iteration: buffers allocated once
        for k in range(4):
            store.put(k, [x, m + k])
        allocated = store.pinned_bytes
        for k in reversed(range(4)):
            if k > 0:
                store.prefetch(k - 1)
            got = store.get(k)
            assert torch.equal(got[0], x) and torch.equal(got[1], m + k)
            store.drop(k)
    assert store.pinned_bytes == allocated
    store.close()


@cuda
def test_cuda_host_tier_survives_freeing_the_source_right_after_put() -> None:
    store = HostStore("cuda", Ledger())
    expected = []
    for k in range(8):
        t = torch.randn(1 << 20, device="cuda")
        expected.append(t.cpu())
        store.put(k, [t * 1.0])  # the temporary is freed at once; the side copy must still see it
        del t
        torch.randn(1 << 22, device="cuda")  # reuse freed blocks on the main stream
    for k in range(8):
        assert torch.equal(store.get(k)[0].cpu(), expected[k])
    store.close()


def test_disk_raw_files_round_trip_every_dtype_and_shape(tmp_path: Path) -> None:
    # checkpoint files hold the payload's raw bytes (dtypes and shapes stay in memory); any
    # payload that cannot be written raw (a sparse tensor) goes through torch.save instead
    tensors = [
        torch.randn(3, 5)[:, ::2],  # not contiguous
        torch.tensor(2.5),  # 0-d
        torch.empty(0, 4),
        torch.randint(-5, 5, (7,), dtype=torch.int16),
        torch.randn(9).to(torch.bfloat16),
        torch.rand(13) > 0.5,
        torch.randn(4, dtype=torch.complex64),
        torch.randn(5, dtype=torch.float64),
    ]
    store = DiskStore("cpu", Ledger(), directory=tmp_path)
    store.put(0, tensors)
    store.put(1, [torch.randn(4, 4).to_sparse()])
    store.flush()
    for got, want in zip(store.get(0), tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    (sparse,) = store.get(1)
    assert sparse.is_sparse
    store.close()
