"""Where tonic looks for SHD and N-MNIST files, and whether they are there. Pure Python.

Kept apart from `spikeckpt.data.datasets` (which imports tonic, about 2 s) so that the
command line can check a data folder before anything slow starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from spikeckpt.data.synthetic import synthetic_marker

__all__ = ["NMNIST_MIN_FILES", "files_present", "location", "shd_placeholder_hint"]

DatasetName = Literal["shd", "nmnist"]
NMNIST_MIN_FILES = 10_000


def location(name: DatasetName, root: str | Path) -> Path:
    """The folder tonic reads for ``name`` under ``root``: ``root/SHD`` or ``root/NMNIST``."""
    return Path(root).expanduser() / {"shd": "SHD", "nmnist": "NMNIST"}[name]


def shd_files(train: bool) -> tuple[str, str]:
    """``(data file, archive placeholder)`` of an SHD split, e.g. ``shd_train.h5(.zip)``."""
    h5 = "shd_train.h5" if train else "shd_test.h5"
    return h5, h5 + ".zip"


def nmnist_files(train: bool) -> tuple[str, str]:
    """``(folder, archive placeholder)`` of an N-MNIST split, e.g. ``Train``, ``train.zip``."""
    return ("Train", "train.zip") if train else ("Test", "test.zip")


def files_present(name: DatasetName, root: str | Path, train: bool) -> bool:
    """Whether tonic will read the split from disk without trying to download it."""
    loc = location(name, root)
    if name == "shd":
        h5, archive = shd_files(train)
        return (loc / h5).is_file() and (loc / archive).is_file()
    folder, archive = nmnist_files(train)
    if not (loc / archive).is_file() or not (loc / folder).is_dir():
        return False
    need = 1 if synthetic_marker(loc) is not None else NMNIST_MIN_FILES
    return any(i + 1 >= need for i, _ in enumerate((loc / folder).glob("**/*.bin")))


def shd_placeholder_hint(root: str | Path) -> str | None:
    """When the SHD ``.h5`` files are there without the ``.zip`` archives tonic checks for:
    a sentence naming the missing archives and the command that fixes it; else None.

    Tonic reads ``shd_{train,test}.h5`` only once ``shd_{train,test}.h5.zip`` exist (an empty
    file will do); after unzipping by hand and deleting the archives, it tries to download.
    """
    loc = location("shd", root)
    missing = [
        loc / archive
        for h5, archive in map(shd_files, (True, False))
        if (loc / h5).is_file() and not (loc / archive).is_file()
    ]
    if not missing:
        return None
    names = " and ".join(p.name for p in missing)
    return (
        f"the data files are in {loc} but the archive{'s' if len(missing) > 1 else ''} {names} "
        f"tonic checks for before reading them {'are' if len(missing) > 1 else 'is'} not: "
        f"`touch {' '.join(str(p) for p in missing)}` fixes it (an empty file will do)"
    )
