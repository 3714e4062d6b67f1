"""spikeckpt.data: synthetic files in the real formats -> stock tonic classes -> data modules."""

from __future__ import annotations

import logging
import math
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

tonic = pytest.importorskip("tonic")
h5py = pytest.importorskip("h5py")
pytest.importorskip("lightning")

from spikeckpt.data import (  # noqa: E402
    DataFileError,
    DataNotFoundError,
    NMNISTDataModule,
    SHDDataModule,
    steps_for,
    write_synthetic_nmnist,
    write_synthetic_shd,
)
from spikeckpt.data.datasets import NMNIST, open_dataset  # noqa: E402
from spikeckpt.data.frames import EventsToSpikes  # noqa: E402
from spikeckpt.data.synthetic import MARKER, SHD_KEYS, encode_nmnist_events  # noqa: E402
from spikeckpt.errors import ConfigError, SpikeckptError  # noqa: E402


def _offline() -> bool:
    try:
        socket.getaddrinfo("zenkelab.org", 443)
    except OSError:
        return True
    return False


@pytest.fixture(scope="module")
def shd_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shd")
    write_synthetic_shd(root, samples=40, test_samples=12, duration_s=0.5, include_empty=True)
    return root


@pytest.fixture(scope="module")
def nmnist_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nmnist")
    write_synthetic_nmnist(root, samples=30, test_samples=10, include_empty=True)
    return root


def _raw_lengths(dataset, dt_us: float) -> list[int]:
    """T of each raw tonic sample: floor(t_last / dt) + 1, 1 for an empty recording."""
    out = []
    for i in range(len(dataset)):
        events, _ = dataset[i]
        out.append(int(events["t"].max() // dt_us) + 1 if len(events) else 1)
    return out


# ------------------------------------------------------------------------------ import hygiene


def test_import_spikeckpt_imports_no_optional_extra() -> None:
    code = (
        "import sys, spikeckpt, spikeckpt.data, spikeckpt.cli;"
        "bad = [m for m in ('tonic', 'h5py', 'lightning') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- files and tonic


def test_shd_file_has_the_public_layout(shd_root: Path) -> None:
    loc = shd_root / "SHD"
    for name in ("shd_train.h5", "shd_test.h5", "shd_train.h5.zip", "shd_test.h5.zip", MARKER):
        assert (loc / name).is_file(), name
    with h5py.File(loc / "shd_train.h5", "r") as f:
        assert h5py.check_vlen_dtype(f["spikes/times"].dtype) == np.float16
        assert h5py.check_vlen_dtype(f["spikes/units"].dtype) == np.uint16
        assert f["labels"].dtype == np.uint16 and f["labels"].shape == (40,)
        assert [k.decode() for k in f["extra/keys"][()]] == list(SHD_KEYS)
        assert f["extra/speaker"].shape == (40,)
        for field in ("gender", "age", "body_height"):
            assert f"extra/meta_info/{field}" in f
        times = f["spikes/times"][3]
        assert np.all(np.diff(times) >= 0) and times.max() <= 0.5


def test_stock_tonic_shd_reads_synthetic_with_class_bands(shd_root: Path) -> None:
    ds = tonic.datasets.SHD(save_to=str(shd_root), train=True)
    assert len(ds) == 40 and len(ds.classes) == 20
    empty, _ = ds[0]
    assert len(empty) == 0
    for i in range(1, 10):
        events, label = ds[i]
        assert events.dtype.names == ("t", "x", "p")
        assert events["t"].max() <= 500_000 and events["x"].max() < 700
        assert 0 <= label < 20
        assert abs(np.median(events["x"]) - (label + 0.5) * 35) < 10  # the class band


def test_nmnist_encoding_round_trips_through_tonic_reader(tmp_path: Path) -> None:
    x = np.array([0, 33, 5, 17])
    y = np.array([0, 33, 20, 9])
    t = np.array([0, 255, 70_000, 2**23 - 1])
    p = np.array([0, 1, 1, 0])
    path = tmp_path / "sample.bin"
    path.write_bytes(encode_nmnist_events(x, y, t, p))
    events = tonic.io.read_mnist_file(str(path), dtype=tonic.datasets.NMNIST.dtype)
    for name, want in zip("xytp", (x, y, t, p), strict=True):
        np.testing.assert_array_equal(events[name], want)


def test_nmnist_subclass_trusts_small_synthetic_folder(nmnist_root: Path) -> None:
    ds = NMNIST(save_to=str(nmnist_root), train=True)
    assert type(ds).__name__ == "NMNIST" and isinstance(ds, tonic.datasets.NMNIST)
    assert ds.location_on_system == str(nmnist_root / "NMNIST")
    assert not tonic.datasets.NMNIST._check_exists(ds)  # stock tonic would download here
    assert len(ds) == 30 and sorted(set(ds.targets)) == list(range(10))
    events, label = ds[0]
    assert len(events) == 0 and label == 0  # include_empty: 0/00000.bin is listed first
    events, label = ds[5]
    assert events["t"].max() < 300_000 and events["x"].max() < 34 and events["y"].max() < 34


@pytest.mark.slow
def test_stock_tonic_nmnist_reads_10000_synthetic_files(tmp_path: Path) -> None:
    write_synthetic_nmnist(tmp_path, samples=10_000, test_samples=1, events_per_second=100)
    ds = tonic.datasets.NMNIST(save_to=str(tmp_path), train=True)
    assert len(ds) == 10_000
    events, label = ds[123]
    assert len(events) > 0 and 0 <= label < 10


def test_writer_refuses_to_overwrite_real_data(tmp_path: Path) -> None:
    (tmp_path / "SHD").mkdir()
    (tmp_path / "SHD" / "shd_train.h5").write_bytes(b"real")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        write_synthetic_shd(tmp_path, samples=4)


@pytest.mark.parametrize("writer", [write_synthetic_shd, write_synthetic_nmnist])
def test_writer_refuses_a_negative_seed_before_writing(tmp_path: Path, writer: Any) -> None:
    """NumPy's ``default_rng(-1)`` said only "expected non-negative integer" (``spikeckpt
    data synth --seed -1`` printed that, naming no argument), after the data folder and its
    marker file were written."""
    with pytest.raises(ConfigError, match=r"seed must be an integer >= 0, got -1"):
        writer(tmp_path, samples=2, seed=-1)
    assert list(tmp_path.iterdir()) == []


def test_writer_is_deterministic(tmp_path: Path) -> None:
    a = write_synthetic_shd(tmp_path / "a", samples=6, seed=3)
    b = write_synthetic_shd(tmp_path / "b", samples=6, seed=3)
    with h5py.File(a / "shd_train.h5") as fa, h5py.File(b / "shd_train.h5") as fb:
        np.testing.assert_array_equal(fa["labels"][()], fb["labels"][()])
        np.testing.assert_array_equal(fa["spikes/units"][2], fb["spikes/units"][2])


# ------------------------------------------------------------------------------- framing


def test_steps_for() -> None:
    assert steps_for(1_000_000, 1000) == 1000
    assert steps_for(1_000_000, 100) == 10_000
    assert steps_for(300_000, 1000) == 300
    assert steps_for(500, 1000) == 1
    with pytest.raises(ValueError, match="dt_us"):
        steps_for(1000, 0)


def test_empty_recording_frames() -> None:
    events = np.zeros(0, dtype=tonic.datasets.SHD.dtype)
    stock = tonic.transforms.ToFrame(sensor_size=(700, 1, 1), time_window=1000)(events)
    assert stock.shape == (1, 1, 700, 1) and stock.dtype == np.float64  # the tonic quirk
    ours = EventsToSpikes((700, 1, 1), dt_us=1000)(events)
    assert ours.shape == (1, 700) and ours.dtype == np.float32 and not ours.any()
    fixed = EventsToSpikes((34, 34, 2), dt_us=1000, duration_us=50_000)(
        np.zeros(0, dtype=tonic.datasets.NMNIST.dtype)
    )
    assert fixed.shape == (50, 2, 34, 34)


def _events(dtype: np.dtype, t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    events = np.zeros(len(t), dtype=dtype)
    events["t"] = np.sort(t)
    if "y" in dtype.names:  # N-MNIST: 34 x 34 pixels, 2 polarities
        for name, high in (("x", 34), ("y", 34), ("p", 2)):
            events[name] = rng.integers(0, high, len(t))
    else:  # SHD: 700 channels, the polarity tonic adds (1)
        events["x"], events["p"] = rng.integers(0, 700, len(t)), 1
    return events


@pytest.mark.parametrize("dt_us", [1e6 / 300, 1e6 / 700, 333.3])
def test_events_on_step_boundaries_count_once(dt_us: float) -> None:
    """tonic's ToFrame ends window k at k*dt + dt and starts k+1 at (k+1)*dt, which differ in
    the last bit for a dt_us that is not a whole number: an event on the boundary was counted
    in two steps or in none (synthetic SHD test split at dt_us=1e6/300: 16,440 counts for
    16,432 events; at 1e6/700: 16,416). Each event now lands in step t // dt_us."""
    rng = np.random.default_rng(0)
    t = np.concatenate([(np.arange(1, 400) * dt_us).astype(np.int64), rng.integers(0, 10**6, 200)])
    for dtype, sensor in ((tonic.datasets.SHD.dtype, (700, 1, 1)), (NMNIST.dtype, (34, 34, 2))):
        events = _events(dtype, t, rng)
        frames = EventsToSpikes(sensor, dt_us=dt_us, binarize=False, flatten=True)(events)
        assert frames.sum() == len(events)
        per_step = np.bincount((events["t"] // dt_us).astype(np.int64), minlength=len(frames))
        assert np.array_equal(frames.sum(axis=1), per_step)


def test_events_to_spikes_matches_tonic_toframe_at_whole_dt() -> None:
    """Same layout and counts as tonic's ToFrame where its windows are exact."""
    rng = np.random.default_rng(1)
    t = rng.integers(0, 300_000, 3000)
    for dtype, sensor in ((tonic.datasets.SHD.dtype, (700, 1, 1)), (NMNIST.dtype, (34, 34, 2))):
        events = _events(dtype, t, rng)
        ours = EventsToSpikes(sensor, dt_us=1000, binarize=False)(events.copy())
        stock = tonic.transforms.ToFrame(
            sensor_size=sensor,
            time_window=1000,
            start_time=0,
            end_time=int(t.max()) + 1,
            include_incomplete=True,
        )(events.copy())
        assert np.array_equal(ours, stock.reshape(ours.shape).astype(np.float32))


def test_events_outside_the_sensor_are_refused() -> None:
    """A unit 800 of 700 raised tonic's bare IndexError; a negative one would wrap around."""
    events = np.zeros(3, dtype=tonic.datasets.SHD.dtype)
    events["t"], events["x"], events["p"] = [0, 10, 20], [3, 800, 5], 1
    with pytest.raises(ConfigError, match=r"x outside the sensor's 0..699 \(e.g. x=800"):
        EventsToSpikes((700, 1, 1), dt_us=1000)(events)


# -------------------------------------------------------------------------- data modules


@pytest.mark.parametrize("dt_us", [1000, 4000, 25_000])
def test_shd_module_T_padding_labels_counts(shd_root: Path, dt_us: int) -> None:
    dm = SHDDataModule(shd_root, dt_us=dt_us, batch_size=12, binarize=False, download=False)
    dm.setup()
    x, y = next(iter(dm.test_dataloader()))
    raw = tonic.datasets.SHD(save_to=str(shd_root), train=False)
    lengths = _raw_lengths(raw, dt_us)
    assert x.shape == (max(lengths), 12, 700) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == [int(raw[i][1]) for i in range(12)]
    assert dm.T is None and max(lengths) <= math.ceil(500_000 / dt_us)
    for i, length in enumerate(lengths):
        assert not x[length:, i].any()  # zero padding after the sample's end
        assert x[:, i].sum() == len(raw[i][0])  # every spike counted once
        if i > 0:
            assert x[length - 1, i].any()  # the last bin holds the last spike
    assert not x[:, 0].any()  # the empty recording


@pytest.mark.parametrize("dt_us", [1000, 10_000])
def test_shd_module_fixed_duration_binarized_downsampled(shd_root: Path, dt_us: int) -> None:
    dm = SHDDataModule(
        shd_root, dt_us=dt_us, duration_us=300_000, channels=70, batch_size=8, download=False
    )
    dm.setup()
    expected_steps = 300_000 // dt_us
    assert (dm.T, dm.frame_shape) == (expected_steps, (70,))
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader()):
        x, y = next(iter(loader))
        assert x.shape[0] == dm.T and x.shape[2] == 70
        assert set(x.unique().tolist()) <= {0.0, 1.0}
        assert y.min() >= 0 and y.max() < 20


def test_counts_exceed_one_without_binarize(shd_root: Path) -> None:
    dm = SHDDataModule(shd_root, dt_us=50_000, channels=20, binarize=False, download=False)
    dm.setup()
    x, _ = next(iter(dm.test_dataloader()))
    assert x.max() > 1


def test_split_is_seeded_disjoint_and_complete(shd_root: Path) -> None:
    def split(seed: int, fraction: float = 0.25) -> tuple[list[int], list[int]]:
        dm = SHDDataModule(shd_root, val_fraction=fraction, seed=seed, download=False)
        dm.setup()
        return list(dm.train_set.indices), list(dm.val_set.indices)

    train, val = split(0)
    assert len(val) == 10 and sorted(train + val) == list(range(40))
    assert split(0) == (train, val)
    assert split(1)[1] != val
    dm = SHDDataModule(shd_root, val_fraction=0.0, download=False)
    dm.setup()
    assert dm.val_dataloader() == [] and len(dm.train_set) == 40


def test_two_workers_give_the_same_batches(shd_root: Path) -> None:
    """Epoch after epoch, as Lightning iterates one loader: the second epoch's order depended
    on ``num_workers`` (the shuffle shared its generator with the workers' base seed, which is
    drawn at each epoch without workers but once with persistent workers)."""

    def batches(workers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dm = SHDDataModule(
            shd_root, dt_us=10_000, batch_size=8, num_workers=workers, seed=5, download=False
        )
        dm.setup()
        loader = dm.train_dataloader()
        return [batch for _epoch in range(2) for batch in loader]

    serial, parallel = batches(0), batches(2)
    assert len(serial) == len(parallel) == 10
    assert not torch.equal(serial[0][1], serial[5][1])  # each epoch shuffled anew
    for (xa, ya), (xb, yb) in zip(serial, parallel, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


def test_a_resumed_or_reloaded_fit_sees_the_batches_of_one_fit(
    shd_root: Path, tmp_path: Path
) -> None:
    """The shuffle's order is a function of the seed and the epoch: a fit resumed from the
    first epoch's checkpoint, or one reloading its loaders each epoch, trains as one fit (the
    loader built anew restarted the seeded order: epoch 2 repeated epoch 1's batches)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(700, 20)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return torch.nn.functional.cross_entropy(self.fc(x.mean(0)), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    def fit(epochs: int, **kwargs: Any) -> Tiny:
        model, ckpt_path = Tiny(), kwargs.pop("ckpt_path", None)
        options: dict[str, Any] = dict(
            accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        )  # fmt: skip
        options.update(kwargs)
        dm = SHDDataModule(shd_root, dt_us=50_000, batch_size=8, val_fraction=0, download=False)
        L.Trainer(max_epochs=epochs, **options).fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return model

    whole = fit(3).fc.weight
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    fit(1, callbacks=[saver], enable_checkpointing=True)
    resumed = fit(3, ckpt_path=saver.best_model_path).fc.weight
    reloaded = fit(3, reload_dataloaders_every_n_epochs=1).fc.weight
    assert torch.equal(resumed, whole) and torch.equal(reloaded, whole)


def test_a_new_train_loader_each_epoch_reshuffles(shd_root: Path) -> None:
    """``for epoch ...: for x, y in dm.train_dataloader()`` (a plain loop asking for the loader
    each epoch) gave every epoch the same order: each loader started a new sampler at epoch
    0. The loaders now share one sampler: the orders of one loader passed over again."""
    kwargs: dict[str, Any] = {"dt_us": 50_000, "batch_size": 4, "download": False}
    fresh = SHDDataModule(shd_root, **kwargs)
    fresh.setup()
    asked_each_epoch = [
        torch.cat([y for _, y in fresh.train_dataloader()]).tolist() for _ in range(3)
    ]
    reused = SHDDataModule(shd_root, **kwargs)
    reused.setup()
    loader = reused.train_dataloader()
    one_loader = [torch.cat([y for _, y in loader]).tolist() for _ in range(3)]
    assert asked_each_epoch == one_loader
    assert asked_each_epoch[0] != asked_each_epoch[1]


def test_disk_cache_keyed_by_settings(shd_root: Path, tmp_path: Path) -> None:
    def first(dt_us: int) -> torch.Tensor:
        dm = SHDDataModule(shd_root, dt_us=dt_us, cache_dir=tmp_path, download=False)
        dm.setup()
        return next(iter(dm.test_dataloader()))[0]

    a = first(5000)
    assert torch.equal(first(5000), a)  # read back from the cache
    b = first(10_000)
    assert b.shape[0] < a.shape[0]
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert [f[:9] for f in folders] == ["shd-test-"] * 2 + ["shd-train"] * 2  # one per dt_us
    assert len(list(tmp_path.glob("shd-test-*/*.hdf5"))) == 2 * 12


def test_nmnist_module_shapes(nmnist_root: Path) -> None:
    dm = NMNISTDataModule(nmnist_root, dt_us=1000, batch_size=10, download=False)
    dm.setup()
    x, y = next(iter(dm.test_dataloader()))
    assert x.shape[1:] == (10, 2, 34, 34) and 270 <= x.shape[0] <= 300
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert not x[:, 0].any() and y[0] == 0  # the empty recording
    flat = NMNISTDataModule(nmnist_root, dt_us=2000, flatten=True, batch_size=4, download=False)
    flat.setup()
    xf, _ = next(iter(flat.train_dataloader()))
    assert xf.shape[1:] == (4, 2312) and xf.shape[0] <= 150 and flat.frame_shape == (2312,)
    first = NMNISTDataModule(nmnist_root, first_saccade_only=True, batch_size=10, download=False)
    first.setup()
    xs, _ = next(iter(first.test_dataloader()))
    assert xs.shape[0] <= 100


# --------------------------------------------------------------------------- missing data


@pytest.mark.parametrize("module", [SHDDataModule, NMNISTDataModule])
def test_missing_files_without_download(module: type, tmp_path: Path) -> None:
    dm = module(tmp_path, download=False)
    with pytest.raises(DataNotFoundError) as info:
        dm.setup()
    message = str(info.value)
    assert str(dm.location) in message and "spikeckpt data synth" in message
    assert "synthetic=True" in message
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, SpikeckptError)


@pytest.mark.skipif(not _offline(), reason="online: tonic would download the real data set")
@pytest.mark.parametrize("module", [SHDDataModule, NMNISTDataModule])
def test_offline_download_failure_becomes_data_not_found(module: type, tmp_path: Path) -> None:
    dm = module(tmp_path)  # the real tonic classes try to download and fail offline
    with pytest.raises(DataNotFoundError, match="spikeckpt data synth") as info:
        dm.setup()
    assert "URLError" in str(info.value) and str(dm.location) in str(info.value)


def test_missing_archive_placeholder_is_explained(tmp_path: Path) -> None:
    write_synthetic_shd(tmp_path, samples=4)
    (tmp_path / "SHD" / "shd_train.h5.zip").unlink()
    with pytest.raises(DataNotFoundError, match="touch"):
        SHDDataModule(tmp_path, download=False).setup()


def test_unreadable_h5_names_the_file_and_the_fix(tmp_path: Path) -> None:
    write_synthetic_shd(tmp_path, samples=4)
    broken = tmp_path / "SHD" / "shd_train.h5"
    broken.write_bytes(b"<html>not found</html>")  # e.g. a download that saved an error page
    with pytest.raises(DataFileError) as info:
        SHDDataModule(tmp_path, download=False).setup()
    message = str(info.value)
    assert f"{broken} is not an HDF5 file" in message
    assert "shd_train.h5.zip again" in message and "spikeckpt data synth" in message
    assert isinstance(info.value, SpikeckptError)


@pytest.mark.parametrize("dropped", ["extra", "spikes/units"])
def test_an_shd_file_without_a_dataset_names_it(tmp_path: Path, dropped: str) -> None:
    """tonic raised h5py's raw KeyError ("component not found"), naming no dataset: at
    opening for ``extra/keys``, at the first sample for ``spikes/units``."""
    import h5py

    write_synthetic_shd(tmp_path, samples=4)
    path = tmp_path / "SHD" / "shd_train.h5"
    with h5py.File(path, "a") as f:
        del f[dropped]
    with pytest.raises(DataFileError, match=f"{path} lacks the dataset.*{dropped}"):
        SHDDataModule(tmp_path, download=False).setup()


def _edit_shd_labels(path: Path, edit: Any) -> None:
    import h5py

    with h5py.File(path, "a") as f:
        labels = edit(f["labels"][:])
        del f["labels"]
        f["labels"] = labels


def test_an_shd_file_with_fewer_labels_than_recordings_is_refused(tmp_path: Path) -> None:
    """tonic takes len(labels) samples: 16 recordings and 10 labels gave a module reading 10 of
    them, without a word (h31 t3.py)."""
    write_synthetic_shd(tmp_path, samples=16)
    path = tmp_path / "SHD" / "shd_train.h5"
    _edit_shd_labels(path, lambda labels: labels[:10])
    with pytest.raises(DataFileError, match=f"{path} holds recordings and labels of different"):
        SHDDataModule(tmp_path, download=False).setup()


def test_an_shd_label_outside_the_classes_is_refused(tmp_path: Path) -> None:
    write_synthetic_shd(tmp_path, samples=8)
    path = tmp_path / "SHD" / "shd_train.h5"
    _edit_shd_labels(path, lambda labels: np.where(np.arange(len(labels)) == 3, 25, labels))
    with pytest.raises(DataFileError, match=r"outside SHD's classes 0..19 \(e.g. 25\)"):
        SHDDataModule(tmp_path, download=False).setup()


def test_a_damaged_shd_file_names_the_file(tmp_path: Path) -> None:
    """An h5 whose middle is zeroed opens, then h5py raised a raw RuntimeError ('bad symbol
    table node signature') naming no file."""
    write_synthetic_shd(tmp_path, samples=8)
    path = tmp_path / "SHD" / "shd_train.h5"
    data = path.read_bytes()
    path.write_bytes(data[:2000] + bytes(len(data) - 4000) + data[-2000:])
    with pytest.raises(DataFileError, match=f"{path} is a damaged HDF5 file") as info:
        SHDDataModule(tmp_path, download=False).setup()
    assert "spikeckpt data synth" in str(info.value)


def test_an_nmnist_file_cut_short_names_the_file(tmp_path: Path) -> None:
    """A .bin file cut mid-event (an unzip interrupted) gave NumPy's 'operands could not be
    broadcast together with shapes (3647,) (3646,)' at its sample, naming no file."""
    write_synthetic_nmnist(tmp_path, samples=4)
    path = sorted((tmp_path / "NMNIST" / "Train").glob("**/*.bin"))[0]
    path.write_bytes(path.read_bytes()[:-2])
    dm = NMNISTDataModule(tmp_path, download=False, val_fraction=0.0, batch_size=4)
    dm.setup()
    with pytest.raises(DataFileError, match=f"{path} holds .* not a whole number of 5-byte"):
        next(iter(dm.train_dataloader()))


def _edit_shd_units(path: Path, sample: int, edit: Any) -> None:
    import h5py

    with h5py.File(path, "a") as f:
        f["spikes/units"][sample] = edit(f["spikes/units"][sample])


@pytest.mark.parametrize("damage", ["units_short", "unit_800"])
def test_a_damaged_shd_recording_names_the_file_and_sample(tmp_path: Path, damage: str) -> None:
    """A recording whose units are fewer than its times raised NumPy's 'operands could not be
    broadcast together' from tonic's reader; a unit past 699, the binning's refusal: neither
    named the file or the sample (h31). Through the loader's worker processes too."""
    write_synthetic_shd(tmp_path, samples=8)
    path = tmp_path / "SHD" / "shd_train.h5"
    if damage == "units_short":
        _edit_shd_units(path, 5, lambda units: units[:-3])
    else:
        _edit_shd_units(path, 5, lambda units: np.where(np.arange(len(units)) == 2, 800, units))
    cause = (
        r"its recording holds \d+ spike times and \d+ units .*ValueError: could not broadcast"
        if damage == "units_short"
        else r"1 event\(s\) with x outside the sensor's 0..699"
    )
    dataset = open_dataset("shd", tmp_path, train=True, download=False)
    dataset.transform = EventsToSpikes((700, 1, 1), dt_us=4000)
    assert dataset[4][0].shape[1:] == (700,)  # the others read as before
    with pytest.raises(DataFileError, match=f"{path}, sample 5: {cause}") as info:
        dataset[5]
    assert "spikeckpt data synth" in str(info.value)
    dm = SHDDataModule(tmp_path, download=False, val_fraction=0.0, batch_size=8, num_workers=2)
    dm.setup()
    with pytest.raises(DataFileError, match=f"{path}, sample 5"):
        next(iter(dm.train_dataloader()))


def test_an_nmnist_recording_off_the_sensor_names_the_file(tmp_path: Path) -> None:
    """A .bin of whole 5-byte events whose x is past the 34x34 sensor (another file under an
    N-MNIST name) raised the binning's refusal, naming no file."""
    write_synthetic_nmnist(tmp_path, samples=4)
    path = sorted((tmp_path / "NMNIST" / "Train").glob("**/*.bin"))[0]
    path.write_bytes(bytes([200, 3, 0, 0, 10]) * 4)
    dm = NMNISTDataModule(tmp_path, download=False, val_fraction=0.0, batch_size=4)
    dm.setup()
    with pytest.raises(DataFileError, match=f"{path}, sample .*x outside the sensor") as info:
        next(iter(dm.train_dataloader()))
    assert "Train.zip there again" in str(info.value)


def test_a_transform_of_yours_that_fails_is_not_called_a_damaged_file(tmp_path: Path) -> None:
    """What a transform of yours raises on a sound recording reaches you as it is."""
    write_synthetic_shd(tmp_path, samples=4)

    def transform(events: np.ndarray) -> np.ndarray:
        raise ValueError("my transform")

    dataset = open_dataset("shd", tmp_path, train=True, transform=transform, download=False)
    with pytest.raises(ValueError, match="my transform") as info:
        dataset[1]
    assert not isinstance(info.value, DataFileError)


def test_an_interrupted_synthetic_write_leaves_nothing_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spikeckpt.data import synthetic

    def cut_short(tmp: Path, *args: Any) -> None:
        tmp.write_bytes(b"half an HDF5 file")
        raise KeyboardInterrupt  # Ctrl-C while h5py writes

    with monkeypatch.context() as patch:
        patch.setattr(synthetic, "_write_shd_layout", cut_short)
        with pytest.raises(KeyboardInterrupt):
            write_synthetic_shd(tmp_path, samples=4)
    location = tmp_path / "SHD"
    assert sorted(p.name for p in location.iterdir()) == [MARKER]  # no .tmp, no .h5
    assert synthetic.synthetic_marker(location)["complete"] is False
    write_synthetic_shd(tmp_path, samples=4)  # ours: written again, not refused as real data
    assert synthetic.synthetic_marker(location)["complete"] is True


def test_synthetic_true_writes_and_uses_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dm = SHDDataModule(tmp_path, synthetic=True, synthetic_samples=20, dt_us=20_000)
    with caplog.at_level(logging.WARNING, logger="spikeckpt.data"):
        dm.prepare_data()
        dm.setup()
    assert "synthetic" in caplog.text and dm.is_synthetic
    assert len(dm.train_set) + len(dm.val_set) == 20 and len(dm.test_set) == 5
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape[1:] == (18, 700)
    nm = NMNISTDataModule(tmp_path, synthetic=True, synthetic_samples=10, batch_size=2)
    nm.setup()
    assert len(nm.test_set) == 2 and nm.is_synthetic


@pytest.mark.parametrize("module", [SHDDataModule, NMNISTDataModule])
def test_synthetic_samples_given_rewrites_synthetic_files_of_another_size(
    module: type, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """synthetic_samples=12 on a root holding synthetic files of 4 recordings: the module used
    to train on the 4 (an INFO line alone); it now rewrites them with 12, and says so. Without
    synthetic_samples, or with synthetic=False, the files there are used as they are."""
    kwargs: dict[str, Any] = {"dt_us": 20_000, "val_fraction": 0.0, "batch_size": 4}
    first = module(tmp_path, synthetic=True, synthetic_samples=4, **kwargs)
    first.setup()
    assert len(first.train_set) == 4
    for as_found in (
        module(tmp_path, synthetic=True, **kwargs),
        module(tmp_path, synthetic_samples=12, **kwargs),
    ):
        as_found.setup()
        assert len(as_found.train_set) == 4
    asked = module(tmp_path, synthetic=True, synthetic_samples=12, **kwargs)
    with caplog.at_level(logging.WARNING, logger="spikeckpt.data"):
        asked.setup()
    assert len(asked.train_set) == 12
    assert "of 4 training recordings, not synthetic_samples=12" in caplog.text


def test_synthetic_samples_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="synthetic_samples must be >= 1"):
        SHDDataModule(tmp_path, synthetic=True, synthetic_samples=0)


# ------------------------------------------------------------------------------ training


EPOCHS = 2


@pytest.mark.slow
def test_snntorch_learns_synthetic_shd(tmp_path: Path) -> None:
    snn = pytest.importorskip("snntorch")
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: 2 threads on a busy 2-core machine ran 30x slower
    try:
        accuracy = _train_and_test(snn, tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert accuracy > 2.5 / 20, f"accuracy {accuracy:.2f} vs chance 0.05"


def _train_and_test(snn: Any, tmp_path: Path) -> float:
    """Train Linear-Leaky-Linear-Leaky on synthetic SHD; return the test accuracy."""
    write_synthetic_shd(tmp_path, samples=200, test_samples=60, duration_s=0.5, seed=1)
    dm = SHDDataModule(tmp_path, dt_us=10_000, channels=100, batch_size=20, download=False)
    dm.setup()
    fc1, fc2 = torch.nn.Linear(100, 64), torch.nn.Linear(64, 20)
    lif1, lif2 = snn.Leaky(beta=0.9), snn.Leaky(beta=0.9)
    params = [*fc1.parameters(), *fc2.parameters()]
    opt = torch.optim.Adam(params, lr=5e-3)

    def forward(x: torch.Tensor) -> torch.Tensor:
        """(T, B, 100) spikes -> (B, 20) logits: output membrane averaged over time."""
        mem1 = torch.zeros(x.shape[1], 64)
        mem2 = torch.zeros(x.shape[1], 20)
        total = torch.zeros(x.shape[1], 20)
        for x_t in x:
            spk1, mem1 = lif1(fc1(x_t), mem1)
            _, mem2 = lif2(fc2(spk1), mem2)
            total = total + mem2
        return total / len(x)

    for _ in range(EPOCHS):
        for x, y in dm.train_dataloader():
            loss = torch.nn.functional.cross_entropy(forward(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    correct = total = 0
    with torch.no_grad():
        for x, y in dm.test_dataloader():
            correct += int((forward(x).argmax(1) == y).sum())
            total += len(y)
    return correct / total


@pytest.mark.slow
def test_lightning_trainer_fits_on_shd_module(tmp_path: Path) -> None:
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(700, 20)

        def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.fc(x.mean(0)), y)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.step(batch)

        def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            # time-first batches: Lightning would take T for the batch size
            self.log("val_loss", self.step(batch), batch_size=len(batch[1]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = SHDDataModule(tmp_path, synthetic=True, synthetic_samples=24, dt_us=20_000, batch_size=8)
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), datamodule=dm)
    assert trainer.state.finished and "val_loss" in trainer.callback_metrics
