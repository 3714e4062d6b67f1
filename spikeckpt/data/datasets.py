"""Opening tonic's SHD and N-MNIST classes, with clear errors when their files are missing.

Tonic (1.7.0) reads ``save_to/<ClassName>``, checks no MD5 once the data are present, and when its
existence check fails calls ``download()``, which raises ``urllib.error.URLError`` offline (there
is no ``download=False``). The existence checks:

- SHD: the archive ``shd_{train,test}.h5.zip`` exists (any content) and some ``*.h5`` lies below
  ``save_to/SHD``; samples are then read from ``save_to/SHD/shd_{train,test}.h5``.
- N-MNIST: the archive ``train.zip`` / ``test.zip`` exists and at least 10,000 ``*.bin`` files lie
  below ``Train/`` / ``Test/``. :class:`NMNIST` below also accepts a synthetic folder with fewer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal
from urllib.error import URLError

import tonic

from spikeckpt.data.errors import DataNotFoundError
from spikeckpt.data.synthetic import synthetic_marker

DatasetName = Literal["shd", "nmnist"]
NMNIST_MIN_FILES = 10_000


class NMNIST(tonic.datasets.NMNIST):
    """``tonic.datasets.NMNIST`` that also trusts a synthetic folder with < 10,000 files.

    Stock tonic only trusts ``root/NMNIST/Train`` (or ``Test``) once it holds 10,000 ``.bin``
    files, and otherwise downloads. This subclass keeps the class name (tonic derives the folder,
    ``root/NMNIST``, from it) and all of tonic's reading code; its ``_check_exists`` adds one case:
    the archive placeholder exists, the folder carries spikeckpt's ``SPIKECKPT_SYNTHETIC.json``
    marker, and at least one ``.bin`` file is present. Real data are checked exactly as by tonic.
    """

    def _check_exists(self) -> bool:
        if super()._check_exists():
            return True
        return (
            synthetic_marker(self.location_on_system) is not None
            and self._is_file_present()
            and self._folder_contains_at_least_n_files_of_type(1, ".bin")
        )


def location(name: DatasetName, root: str | Path) -> Path:
    """The folder tonic reads for ``name`` under ``root``: ``root/SHD`` or ``root/NMNIST``."""
    return Path(root).expanduser() / {"shd": "SHD", "nmnist": "NMNIST"}[name]


def _shd_files(train: bool) -> tuple[str, str]:
    h5 = "shd_train.h5" if train else "shd_test.h5"
    return h5, h5 + ".zip"


def _nmnist_files(train: bool) -> tuple[str, str]:
    return ("Train", "train.zip") if train else ("Test", "test.zip")


def files_present(name: DatasetName, root: str | Path, train: bool) -> bool:
    """Whether tonic will read the split from disk without trying to download it."""
    loc = location(name, root)
    if name == "shd":
        h5, archive = _shd_files(train)
        return (loc / h5).is_file() and (loc / archive).is_file()
    folder, archive = _nmnist_files(train)
    if not (loc / archive).is_file() or not (loc / folder).is_dir():
        return False
    need = 1 if synthetic_marker(loc) is not None else NMNIST_MIN_FILES
    return any(i + 1 >= need for i, _ in enumerate((loc / folder).glob("**/*.bin")))


def missing_message(
    name: DatasetName, root: str | Path, train: bool, cause: BaseException | None = None
) -> str:
    """Explain which files tonic needs where, why they were not fetched, and the ways out."""
    loc = location(name, root)
    split = "train" if train else "test"
    if name == "shd":
        h5, archive = _shd_files(train)
        title = "SHD"
        needs = (
            f"{loc / h5} and the archive {loc / archive} beside it (tonic only checks that the "
            "archive exists: once it is unzipped an empty file of that name will do)"
        )
        if (loc / h5).is_file() and not (loc / archive).is_file():
            needs += f". {h5} is there but {archive} is not: `touch {loc / archive}` fixes it"
        url = tonic.datasets.SHD.base_url + archive
    else:
        folder, archive = _nmnist_files(train)
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
    ``transform`` turns them into something else. Raises :class:`DataNotFoundError` when the
    files are missing and the download fails (always the case offline) or ``download=False``.
    """
    if not download and not files_present(name, root, train):
        raise DataNotFoundError(missing_message(name, root, train))
    save_to = str(Path(root).expanduser())
    try:
        if name == "shd":
            return tonic.datasets.SHD(save_to=save_to, train=train, transform=transform)
        return NMNIST(
            save_to=save_to,
            train=train,
            first_saccade_only=first_saccade_only,
            transform=transform,
        )
    except (URLError, ConnectionError, TimeoutError) as err:
        raise DataNotFoundError(missing_message(name, root, train, err)) from err
