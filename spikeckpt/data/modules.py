"""Lightning data modules for SHD and N-MNIST on tonic, batches time-first for long sequences."""

from __future__ import annotations

import hashlib
import json
import logging
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import Any, ClassVar, cast

import lightning as L
import numpy as np
import torch
from tonic import DiskCachedDataset
from tonic.transforms import Downsample
from torch.utils.data import DataLoader, Dataset, RandomSampler, Subset

from spikeckpt.data.datasets import DatasetName, files_present, location, open_dataset
from spikeckpt.data.frames import (
    Chain,
    EventsToSpikes,
    PackTimeFirst,
    pad_time_first,
    seed_worker,
    steps_for,
)
from spikeckpt.data.synthetic import (
    MARKER,
    NMNIST_CLASSES,
    SHD_CHANNELS,
    SHD_CLASSES,
    synthetic_marker,
    write_synthetic_nmnist,
    write_synthetic_shd,
)
from spikeckpt.errors import ConfigError, UsageError
from spikeckpt.storage.spiketrain import SPIKE_TRAIN_CODECS, SpikeTrain

log = logging.getLogger("spikeckpt.data")
#: part of the disk-cache key: 2 since EventsToSpikes bins exactly (frames cached by format 1
#: at a dt_us that is not a whole number could count a boundary event twice or not at all)
_CACHE_FORMAT = 2


class EpochShuffle(RandomSampler):
    """A shuffle whose order is a function of ``(seed, epoch)`` alone, so that a fit's batches
    do not depend on how it got to an epoch: resumed from a checkpoint, with its loaders
    reloaded (``reload_dataloaders_every_n_epochs``), with 0 or several (persistent) workers.

    Lightning calls ``set_epoch(epoch)`` at the start of each epoch, as it does for a
    ``DistributedSampler``; in a plain loop each pass over the loader is the next epoch. A
    ``RandomSampler``, so that Lightning shuffles under DDP too (its ``DistributedSampler``
    replaces this one there).
    """

    def __init__(self, data_source: Sized, seed: int) -> None:
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Give the next pass the order of ``epoch`` (0-based)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        entropy = np.random.SeedSequence([self.seed, self.epoch]).generate_state(2, np.uint32)
        generator = torch.Generator().manual_seed(int(entropy[0]) << 32 | int(entropy[1]))
        self.epoch += 1
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class _EventDataModule(L.LightningDataModule):
    """Shared machinery: file checks, synthetic fallback, split, caching, loaders."""

    dataset_name: ClassVar[DatasetName]
    num_classes: ClassVar[int]
    #: training recordings written with ``synthetic=True`` when ``synthetic_samples`` is None
    default_synthetic_samples: ClassVar[int]

    def __init__(
        self,
        root: str | Path,
        *,
        dt_us: float,
        duration_us: float | None,
        batch_size: int,
        num_workers: int,
        binarize: bool,
        val_fraction: float,
        seed: int,
        synthetic: bool,
        synthetic_samples: int | None,
        cache_dir: str | Path | None,
        download: bool,
        pin_memory: bool,
        packed: bool | str = False,
        input_on_host: bool = False,
    ) -> None:
        super().__init__()
        steps_for(dt_us if duration_us is None else duration_us, dt_us)  # validates both
        self.packed = _check_packed(packed, binarize)
        if input_on_host and not self.packed:
            raise ConfigError(
                "input_on_host=True keeps the packed spike train on the host: it needs "
                "packed=True (a dense batch left on the host cannot be unpacked per step)"
            )
        self.input_on_host = input_on_host
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        if synthetic_samples is not None and synthetic_samples < 1:
            raise ConfigError(f"synthetic_samples must be >= 1, got {synthetic_samples}")
        self.root = Path(root).expanduser()
        self.dt_us = dt_us
        self.duration_us = duration_us
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.binarize = binarize
        self.val_fraction = val_fraction
        self.seed = seed
        self.synthetic = synthetic
        #: whether ``synthetic_samples`` was given: then synthetic files of another size are
        #: rewritten (with None, whatever synthetic set is there is used)
        self._samples_asked = synthetic_samples is not None
        self.synthetic_samples: int = (
            self.default_synthetic_samples if synthetic_samples is None else synthetic_samples
        )
        self.cache_dir = None if cache_dir is None else Path(cache_dir).expanduser()
        self.download = download
        self.pin_memory = pin_memory
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self._train_sampler: EpochShuffle | None = None

    # ---------------------------------------------------------------- per-dataset parts

    @abstractmethod
    def transform(self) -> Callable:
        """The tonic transform from raw events to ``(T, *frame_shape)`` float32 frames."""

    @abstractmethod
    def _write_synthetic(self) -> Path: ...

    @abstractmethod
    def _settings(self) -> dict[str, Any]:
        """Everything the framed samples depend on (the disk-cache key)."""

    def _open(self, train: bool) -> Dataset:
        return open_dataset(
            self.dataset_name,
            self.root,
            train=train,
            transform=self.transform(),
            download=self.download,
        )

    # ---------------------------------------------------------------- public helpers

    @property
    def location(self) -> Path:
        """Folder tonic reads: ``root/SHD`` or ``root/NMNIST``."""
        return location(self.dataset_name, self.root)

    @property
    def T(self) -> int | None:
        """Time steps per batch when ``duration_us`` is set; None when lengths vary per batch."""
        return None if self.duration_us is None else steps_for(self.duration_us, self.dt_us)

    def steps_for(self, duration_us: float) -> int:
        """Time steps that a recording of ``duration_us`` microseconds gives at this ``dt_us``."""
        return steps_for(duration_us, self.dt_us)

    @property
    def is_synthetic(self) -> bool:
        """Whether the files under `location` were written by spikeckpt's writers."""
        return synthetic_marker(self.location) is not None

    # ---------------------------------------------------------------- Lightning hooks

    def prepare_data(self) -> None:
        """Write synthetic files if asked to and the real ones are absent (rank 0 only)."""
        self._ensure_files()

    def _ensure_files(self) -> None:
        present = all(files_present(self.dataset_name, self.root, train) for train in (True, False))
        stale = self._stale_synthetic() if present else None
        if present and stale is None:
            if self.is_synthetic:
                log.info("using synthetic %s files in %s", self.dataset_name, self.location)
            return
        if not self.synthetic:
            return  # tonic will try to download; a failure becomes DataNotFoundError
        try:
            written = self._write_synthetic()
        except FileExistsError:
            return  # incomplete real data there: let tonic and the error message handle it
        log.warning(
            "%s: %s; wrote %d synthetic training recordings there (synthetic=True) and using them",
            written,
            stale or f"{self.dataset_name} files not found",
            self.synthetic_samples,
        )

    def _stale_synthetic(self) -> str | None:
        """Why the synthetic files present must be rewritten (``synthetic=True``): an
        interrupted write, or another size than ``synthetic_samples`` asks for; else None."""
        marker = synthetic_marker(self.location)
        if not self.synthetic or marker is None:
            return None
        if marker.get("complete", True) is False:
            return f"synthetic {self.dataset_name} files cut short"
        held = marker.get("train_samples")
        if self._samples_asked and held is not None and held != self.synthetic_samples:
            return (
                f"synthetic {self.dataset_name} files of {held} training recordings, not "
                f"synthetic_samples={self.synthetic_samples}"
            )
        return None

    def setup(self, stage: str | None = None) -> None:
        """Open the train (split into train/val with ``seed``) and test sets."""
        if self.train_set is not None:
            return
        self._ensure_files()
        full: Any = self._cached(self._open(train=True), "train")
        n = len(full)
        n_val = 0
        if self.val_fraction > 0 and n > 1:
            n_val = min(n - 1, max(1, round(n * self.val_fraction)))
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()
        self.val_set = Subset(full, sorted(order[:n_val]))
        self.train_set = Subset(full, order[n_val:])
        self.test_set = self._cached(self._open(train=False), "test")

    def _cached(self, dataset: Dataset, split: str) -> Dataset:
        if self.cache_dir is None:
            return dataset
        settings = {"format": _CACHE_FORMAT, "split": split, **self._settings()}
        data_file = self._data_fingerprint(split)
        key = hashlib.sha1(json.dumps([settings, data_file], sort_keys=True).encode()).hexdigest()
        path = self.cache_dir / f"{self.dataset_name}-{split}-{key[:16]}"
        return DiskCachedDataset(dataset, cache_path=str(path))

    def _data_fingerprint(self, split: str) -> list[Any]:
        """Size/mtime of the data read, so regenerated files do not hit a stale cache."""
        paths = [self.location / p for p in self._data_paths(split)]
        return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths if p.exists()]

    @abstractmethod
    def _data_paths(self, split: str) -> list[str]: ...

    def _shuffle(self, dataset: Dataset) -> EpochShuffle:
        """The training sampler, one per training set: a loader asked for again (a plain loop
        calling ``train_dataloader()`` each epoch) continues its epochs instead of starting
        over at epoch 0, which gave every epoch the same order."""
        sampler = self._train_sampler
        if sampler is None or sampler.data_source is not dataset:
            sampler = self._train_sampler = EpochShuffle(cast(Sized, dataset), self.seed)
        return sampler

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise UsageError(f"{type(self).__name__}.setup() must run before asking for data")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self._shuffle(dataset) if shuffle else None,
            num_workers=self.num_workers,
            collate_fn=PackTimeFirst(self.packed) if self.packed else pad_time_first,
            worker_init_fn=seed_worker,
            generator=torch.Generator().manual_seed(self.seed),
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
        )

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        """Move the batch to ``device``: a packed ``x`` moves only its packed bytes (and stays
        on the host with ``input_on_host=True``), everything else as Lightning does."""
        if self.packed and isinstance(batch, (tuple, list)) and batch:
            x, *rest = batch
            if isinstance(x, SpikeTrain):
                moved = super().transfer_batch_to_device(rest, device, dataloader_idx)
                x = x if self.input_on_host else x.to(device, non_blocking=x.is_pinned())
                return type(batch)([x, *moved]) if isinstance(batch, list) else (x, *moved)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded) batches ``(x (T, B, ...) float32, y (B,) int64)``; with
        ``packed`` ``x`` is a [`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain] of that shape.
        The loaders share one sampler: each pass over any of them is the next epoch (Lightning
        sets the epoch itself)."""
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """Validation batches; an empty list (no validation) when ``val_fraction == 0``."""
        if isinstance(self.val_set, Subset) and len(self.val_set) == 0:
            return []
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Batches of the test files, in file order."""
        return self._loader(self.test_set, shuffle=False)


def _check_packed(packed: bool | str, binarize: bool) -> str | None:
    """``packed`` -> the spike-train codec to use, or None for dense batches."""
    if packed is False or packed is None:
        return None
    codec = "auto" if packed is True else packed
    if codec not in SPIKE_TRAIN_CODECS:
        raise ConfigError(
            f"packed must be True, False or a codec in {SPIKE_TRAIN_CODECS}, got {packed!r}"
        )
    if not binarize:
        raise ConfigError(
            "packed batches hold spikes (0 or 1) and binarize=False keeps spike counts: use "
            "binarize=True, or packed=False for dense count batches"
        )
    return codec


class SHDDataModule(_EventDataModule):
    """Spiking Heidelberg Digits (700 channels, 20 classes) via ``tonic.datasets.SHD``.

    Batches: ``x`` float32 ``(T, B, channels)`` (spikes, or counts with ``binarize=False``), time
    first, zero-padded to the longest sample in the batch; ``y`` int64 ``(B,)``. One step is
    ``dt_us`` microseconds from the start of the recording: 1 ms gives T up to ~1,000-1,400,
    0.1 ms T ~ 10,000+. ``duration_us`` fixes ``T = ceil(duration_us / dt_us)`` by dropping later
    spikes and padding.

    Args:
        root: tonic's ``save_to``; files in ``root/SHD`` (see docs/datasets.md).
        channels: fewer than 700 merges neighbouring channels (tonic ``Downsample``).
        val_fraction: share of the training file held out for validation, chosen with ``seed``.
        synthetic: if the files are absent, write synthetic ones (``synthetic_samples`` training
            recordings) under ``root`` and use them, instead of letting tonic download.
        synthetic_samples: training recordings of the synthetic files (default 256; N-MNIST
            200). Given, synthetic files of another size already there are rewritten with
            it; None uses the synthetic files there as they are.
        cache_dir: cache framed samples there (tonic ``DiskCachedDataset``), one folder per
            setting of the transform and data file.
        download: let tonic try to download missing files (it fails offline); with False a
            missing file raises [`DataNotFoundError`][spikeckpt.data.errors.DataNotFoundError] at once.
        packed: batches carry ``x`` as a [`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain] (1 bit per
            element, or index lists when sparser; ``"bitpack"`` / ``"index"`` force one),
            packed once per batch in the loader; it moves to the device as packed bytes. Needs
            ``binarize=True``. At 0.1 ms bins (T = 10,000), 64 recordings take about 56 MB
            bit-packed (far less as index lists) instead of 1.8 GB dense float32.
        input_on_host: with ``packed``, leave ``x`` on the host when Lightning moves the batch
            (unpack steps to the device with ``x.step(t, device)``); ``pin_memory=True`` pins it.
    """

    dataset_name: ClassVar[DatasetName] = "shd"
    num_classes: ClassVar[int] = SHD_CLASSES
    default_synthetic_samples: ClassVar[int] = 256

    def __init__(
        self,
        root: str | Path,
        dt_us: float = 1000,
        duration_us: float | None = None,
        channels: int = SHD_CHANNELS,
        batch_size: int = 32,
        num_workers: int = 0,
        binarize: bool = True,
        val_fraction: float = 0.1,
        seed: int = 0,
        synthetic: bool = False,
        synthetic_samples: int | None = None,
        cache_dir: str | Path | None = None,
        download: bool = True,
        pin_memory: bool = False,
        packed: bool | str = False,
        input_on_host: bool = False,
    ) -> None:
        if not 1 <= channels <= SHD_CHANNELS:
            raise ConfigError(f"channels must lie in 1..{SHD_CHANNELS}, got {channels}")
        self.channels = channels
        super().__init__(
            root,
            dt_us=dt_us,
            duration_us=duration_us,
            batch_size=batch_size,
            num_workers=num_workers,
            binarize=binarize,
            val_fraction=val_fraction,
            seed=seed,
            synthetic=synthetic,
            synthetic_samples=synthetic_samples,
            cache_dir=cache_dir,
            download=download,
            pin_memory=pin_memory,
            packed=packed,
            input_on_host=input_on_host,
        )

    @property
    def frame_shape(self) -> tuple[int, ...]:
        """Shape of one time step of one sample: ``(channels,)``."""
        return (self.channels,)

    def transform(self) -> Callable:
        frames = EventsToSpikes(
            sensor_size=(self.channels, 1, 1),
            dt_us=self.dt_us,
            duration_us=self.duration_us,
            binarize=self.binarize,
        )
        if self.channels == SHD_CHANNELS:
            return frames
        # not tonic's Compose: it returns the raw events of an empty recording unframed
        return Chain((Downsample(spatial_factor=self.channels / SHD_CHANNELS), frames))

    def _write_synthetic(self) -> Path:
        return write_synthetic_shd(self.root, samples=self.synthetic_samples, seed=self.seed)

    def _settings(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset_name,
            "dt_us": self.dt_us,
            "duration_us": self.duration_us,
            "channels": self.channels,
            "binarize": self.binarize,
        }

    def _data_paths(self, split: str) -> list[str]:
        return [f"shd_{split}.h5"]


class NMNISTDataModule(_EventDataModule):
    """Neuromorphic MNIST (34 x 34 pixels, 2 polarities, 10 classes) via tonic's N-MNIST class.

    Batches: ``x`` float32 ``(T, B, 2, 34, 34)`` or ``(T, B, 2312)`` with ``flatten=True``, time
    first, zero-padded (a packed [`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain] with ``packed``);
    ``y`` int64 ``(B,)``. Recordings last ~300 ms: 1 ms steps give T ~ 300,
    0.1 ms T ~ 3,000; ``first_saccade_only`` keeps the first 100 ms. Uses
    [`spikeckpt.data.datasets.NMNIST`][spikeckpt.data.datasets.NMNIST] (tonic's class, also accepting small synthetic
    folders). Other arguments as for [`SHDDataModule`][spikeckpt.data.modules.SHDDataModule].
    """

    dataset_name: ClassVar[DatasetName] = "nmnist"
    num_classes: ClassVar[int] = NMNIST_CLASSES
    default_synthetic_samples: ClassVar[int] = 200
    sensor_size: ClassVar[tuple[int, int, int]] = (34, 34, 2)

    def __init__(
        self,
        root: str | Path,
        dt_us: float = 1000,
        first_saccade_only: bool = False,
        flatten: bool = False,
        duration_us: float | None = None,
        batch_size: int = 32,
        num_workers: int = 0,
        binarize: bool = True,
        val_fraction: float = 0.1,
        seed: int = 0,
        synthetic: bool = False,
        synthetic_samples: int | None = None,
        cache_dir: str | Path | None = None,
        download: bool = True,
        pin_memory: bool = False,
        packed: bool | str = False,
        input_on_host: bool = False,
    ) -> None:
        self.first_saccade_only = first_saccade_only
        self.flatten = flatten
        super().__init__(
            root,
            dt_us=dt_us,
            duration_us=duration_us,
            batch_size=batch_size,
            num_workers=num_workers,
            binarize=binarize,
            val_fraction=val_fraction,
            seed=seed,
            synthetic=synthetic,
            synthetic_samples=synthetic_samples,
            cache_dir=cache_dir,
            download=download,
            pin_memory=pin_memory,
            packed=packed,
            input_on_host=input_on_host,
        )

    @property
    def frame_shape(self) -> tuple[int, ...]:
        """Shape of one time step of one sample: ``(2, 34, 34)`` or ``(2312,)`` flattened."""
        return EventsToSpikes(self.sensor_size, self.dt_us, flatten=self.flatten).frame_shape(True)

    def transform(self) -> Callable:
        return EventsToSpikes(
            sensor_size=self.sensor_size,
            dt_us=self.dt_us,
            duration_us=self.duration_us,
            binarize=self.binarize,
            flatten=self.flatten,
        )

    def _open(self, train: bool) -> Dataset:
        return open_dataset(
            self.dataset_name,
            self.root,
            train=train,
            transform=self.transform(),
            first_saccade_only=self.first_saccade_only,
            download=self.download,
        )

    def _write_synthetic(self) -> Path:
        return write_synthetic_nmnist(self.root, samples=self.synthetic_samples, seed=self.seed)

    def _settings(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset_name,
            "dt_us": self.dt_us,
            "duration_us": self.duration_us,
            "first_saccade_only": self.first_saccade_only,
            "flatten": self.flatten,
            "binarize": self.binarize,
        }

    def _data_paths(self, split: str) -> list[str]:
        return ["Train" if split == "train" else "Test", MARKER]
