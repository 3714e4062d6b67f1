"""Opening tonic's SHD and N-MNIST classes, with clear errors when their files are missing.

Tonic (1.7.0) reads ``save_to/<ClassName>``, checks no MD5 once the data are present, and when its
existence check fails calls ``download()``, which raises ``urllib.error.URLError`` offline (there
is no ``download=False``). The existence checks:

- SHD: the archive ``shd_{train,test}.h5.zip`` exists (any content) and some ``*.h5`` lies below
  ``save_to/SHD``; samples are then read from ``save_to/SHD/shd_{train,test}.h5``.
- N-MNIST: the archive ``train.zip`` / ``test.zip`` exists and at least 10,000 ``*.bin`` files lie
  below ``Train/`` / ``Test/``. [`NMNIST`][spikeckpt.data.datasets.NMNIST] below also accepts a synthetic folder with fewer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.error import URLError

import numpy as np
import tonic

from spikeckpt.data.errors import DataFileError, DataNotFoundError
from spikeckpt.data.files import (
    NMNIST_MIN_FILES,
    DatasetName,
    files_present,
    location,
    nmnist_files,
    shd_files,
    shd_placeholder_hint,
)
from spikeckpt.data.synthetic import SHD_CLASSES, synthetic_marker
from spikeckpt.errors import ConfigError

__all__ = [
    "NMNIST",
    "SHD",
    "NMNIST_MIN_FILES",
    "files_present",
    "location",
    "missing_message",
    "open_dataset",
    "refuse_missing_shd_keys",
    "unreadable_message",
]


@contextlib.contextmanager
def sample_named(path: Path, index: int, fix: str) -> Iterator[None]:
    """Re-raise the binning's refusal of sample ``index`` of ``path`` (`EventsToSpikes`: events
    outside the sensor, which name no file) as a `DataFileError` naming the file, the sample
    and ``fix``; anything else raised passes unchanged."""
    try:
        yield
    except ConfigError as err:  # its own message says what is wrong with the events
        raise DataFileError(f"{path}, sample {index}: {err}. {fix}") from err


class SHD(tonic.datasets.SHD):
    """``tonic.datasets.SHD`` whose damaged samples raise `DataFileError` naming the file and
    the sample: a recording whose units are fewer than its times (tonic's reader raised
    NumPy's 'could not broadcast input array'), one with a unit past 699 (the binning's
    refusal, without the file). The class name stays: tonic derives the folder,
    ``root/SHD``, from it."""

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        path = Path(self.location_on_system) / self.data_filename
        fix = shd_fix(path.parent.parent, train=self.filename == self.train_zip)
        try:
            with sample_named(path, index, fix):
                return super().__getitem__(index)
        except (ValueError, IndexError) as err:  # tonic's reader, or a transform of yours
            counts = _shd_sample_counts(path, index)
            if counts is None or counts[0] == counts[1]:
                raise
            raise DataFileError(
                f"{path}, sample {index}: its recording holds {counts[0]} spike times and "
                f"{counts[1]} units (one unit per spike: tonic's reader failed with "
                f"{type(err).__name__}: {err}). {fix}"
            ) from err


def _shd_sample_counts(path: Path, index: int) -> tuple[int, int] | None:
    """``(spike times, units)`` held by recording ``index`` of the SHD file ``path``, or None
    where they cannot be read."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return len(f["spikes/times"][index]), len(f["spikes/units"][index])
    except (OSError, KeyError, ValueError, IndexError):
        return None


class NMNIST(tonic.datasets.NMNIST):
    """``tonic.datasets.NMNIST`` that also trusts a synthetic folder with < 10,000 files.

    Stock tonic only trusts ``root/NMNIST/Train`` (or ``Test``) once it holds 10,000 ``.bin``
    files, and otherwise downloads. This subclass keeps the class name (tonic derives the folder,
    ``root/NMNIST``, from it) and all of tonic's reading code; its ``_check_exists`` adds one case:
    the archive placeholder exists, the folder carries spikeckpt's ``SPIKECKPT_SYNTHETIC.json``
    marker, and at least one ``.bin`` file is present. Real data are checked exactly as by tonic.
    Reading a sample, a ``.bin`` file that holds no whole number of events raises
    `DataFileError` naming it.
    """

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        """tonic's sample, after checking that the ``.bin`` file holds whole 5-byte events:
        a file cut short (an unzip interrupted) gave NumPy's 'operands could not be broadcast
        together with shapes (3647,) (3646,)', naming no file."""
        path = Path(self.data[index])
        size = path.stat().st_size
        if size % 5:
            raise DataFileError(
                f"{path} holds {size} bytes, not a whole number of 5-byte N-MNIST events: the "
                "file is cut short (an interrupted download or unzip) or is no N-MNIST "
                f"recording. {self._fix()}"
            )
        with sample_named(path, index, self._fix()):
            return super().__getitem__(index)

    def _fix(self) -> str:
        split = "Train" if self.train else "Test"
        return f"Fix: unzip {split}.zip there again (docs/datasets.md), or delete the file."

    def _check_exists(self) -> bool:
        if super()._check_exists():
            return True
        return (
            synthetic_marker(self.location_on_system) is not None
            and self._is_file_present()
            and self._folder_contains_at_least_n_files_of_type(1, ".bin")
        )


def missing_message(
    name: DatasetName, root: str | Path, train: bool, cause: BaseException | None = None
) -> str:
    """Explain which files tonic needs where, why they were not fetched, and the ways out."""
    loc = location(name, root)
    split = "train" if train else "test"
    if name == "shd":
        h5, archive = shd_files(train)
        title = "SHD"
        needs = (
            f"{loc / h5} and the archive {loc / archive} beside it (tonic only checks that the "
            "archive exists: once it is unzipped an empty file of that name will do)"
        )
        hint = shd_placeholder_hint(root)
        if hint:
            needs += f". Here {hint}"
        url = tonic.datasets.SHD.base_url + archive
    else:
        folder, archive = nmnist_files(train)
        title = "N-MNIST"
        needs = (
            f"{loc / folder}/<digit>/*.bin (at least {NMNIST_MIN_FILES:,} files, as in the real "
            f"data set) and the archive {loc / archive} (an empty file will do once unzipped)"
        )
        url = NMNIST.train_url if train else NMNIST.test_url
    text = f"{title} {split} data not found: tonic reads {loc} and needs {needs}."
    if cause is None:
        text += " Downloading is off (download=False)."
    else:
        text += f" Tonic tried to download {url} and failed ({type(cause).__name__}: {cause})."
    text += (
        " Fix: put the real files there (see docs/datasets.md), or write synthetic files in the "
        f"same format with `spikeckpt data synth --dataset {name} --root {root}` "
        f"(spikeckpt.data.write_synthetic_{name}), or pass synthetic=True to the data module."
    )
    return text


def open_dataset(
    name: DatasetName,
    root: str | Path,
    *,
    train: bool,
    transform: Callable | None = None,
    first_saccade_only: bool = False,
    download: bool = True,
) -> tonic.datasets.SHD | NMNIST:
    """Open tonic's dataset class for ``name`` on ``root``.

    Samples are ``(events, label)``: structured event arrays (``t`` in microseconds) unless a
    ``transform`` turns them into something else. Raises [`DataNotFoundError`][spikeckpt.data.errors.DataNotFoundError] when the
    files are missing and the download fails (always the case offline) or ``download=False``,
    and `DataFileError` when an SHD file is there but h5py cannot open it.
    """
    if not download and not files_present(name, root, train):
        raise DataNotFoundError(missing_message(name, root, train))
    if name == "shd" and files_present(name, root, train):
        refuse_missing_shd_keys(root, train)
    save_to = str(Path(root).expanduser())
    try:
        if name == "shd":
            return SHD(save_to=save_to, train=train, transform=transform)
        return NMNIST(
            save_to=save_to,
            train=train,
            first_saccade_only=first_saccade_only,
            transform=transform,
        )
    except (URLError, ConnectionError, TimeoutError) as err:
        raise DataNotFoundError(missing_message(name, root, train, err)) from err
    except OSError as err:  # h5py: the file is there but is no (whole) HDF5 file
        if name != "shd":
            raise
        raise DataFileError(unreadable_message(root, train, err)) from err


#: the datasets tonic's SHD class reads from an SHD file (``extra/*`` when opened, the rest
#: per sample)
SHD_DATASETS = ("spikes/times", "spikes/units", "labels", "extra/keys", "extra/speaker")


def refuse_missing_shd_keys(root: str | Path, train: bool) -> None:
    """Raise `DataFileError` when an SHD file lacks a dataset tonic reads (tonic's raw h5py
    ``KeyError`` names none, at opening or at the first sample), when its ``spikes/times``,
    ``spikes/units`` and ``labels`` differ in length (tonic takes ``len(labels)`` samples and
    drops the rest without a word, or fails with an ``IndexError`` at the end), when a label
    is outside SHD's 20 classes, or when h5py fails inside the file (a damaged file opens but
    raises a raw ``RuntimeError`` that names no file). A file h5py cannot open is left to
    tonic's own opening (`unreadable_message`)."""
    import h5py

    path = location("shd", root) / shd_files(train)[0]
    try:
        f = h5py.File(path, "r")
    except OSError:
        return
    try:
        with f:
            missing = [key for key in SHD_DATASETS if key not in f]
            present = sorted(f.keys())
            lengths = {} if missing else {key: len(f[key]) for key in SHD_DATASETS[:3]}
            labels = None if missing else np.asarray(f["labels"][:])
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        raise DataFileError(unreadable_message(root, train, err)) from err
    fix = shd_fix(root, train)
    if missing:
        raise DataFileError(
            f"{path} lacks the dataset(s) {', '.join(missing)} that tonic's SHD reads (it "
            f"holds {', '.join(present) or 'nothing'} at the top): an SHD file holds "
            f"{', '.join(SHD_DATASETS)}. {fix}"
        )
    if len(set(lengths.values())) > 1:
        sizes = ", ".join(f"{key} {n}" for key, n in lengths.items())
        raise DataFileError(
            f"{path} holds recordings and labels of different counts ({sizes}): every "
            f"recording has its spike times, units and label. {fix}"
        )
    bad = labels[(labels < 0) | (labels >= SHD_CLASSES)] if labels is not None else labels
    if bad is not None and bad.size:
        raise DataFileError(
            f"{path} holds {bad.size} label(s) outside SHD's classes 0..{SHD_CLASSES - 1} "
            f"(e.g. {int(bad[0])}). {fix}"
        )


def shd_fix(root: str | Path, train: bool) -> str:
    """The way out of a damaged SHD file of ``root``'s ``train`` or test split."""
    return (
        f"Fix: download {shd_files(train)[1]} again and unzip it there (docs/datasets.md), or "
        "write synthetic files in the same format with "
        f"`spikeckpt data synth --dataset shd --root {root}` (after moving this file away)."
    )


def unreadable_message(root: str | Path, train: bool, cause: BaseException) -> str:
    """Explain that an SHD file is there but h5py cannot open it, and the ways out."""
    path = location("shd", root) / shd_files(train)[0]
    reason = str(cause)
    if "signature not found" in reason:
        what = "is not an HDF5 file (h5py found no HDF5 signature in it)"
    elif isinstance(cause, OSError):
        what = f"cannot be opened as an HDF5 file ({type(cause).__name__}: {cause})"
    else:
        what = f"is a damaged HDF5 file: h5py fails inside it ({type(cause).__name__}: {cause})"
    return (
        f"{path} {what}: a download or unzip cut short, or another file under that name. "
        f"Fix: download {shd_files(train)[1]} again and unzip it there (docs/datasets.md), or "
        f"write synthetic files in the same format with `spikeckpt data synth --dataset shd "
        f"--root {root}` (after moving the broken file away)."
    )
