"""SHD and N-MNIST for long-sequence training: tonic data modules and synthetic files.

Needs the optional extras ``tonic`` (tonic, h5py) and, for the data modules, ``lightning``:
``pip install "spikeckpt[tonic,lightning]"``. Names are loaded on first use, so
``import spikeckpt.data`` and [`DataNotFoundError`][spikeckpt.data.errors.DataNotFoundError] need neither.

Public names: [`SHDDataModule`][spikeckpt.data.modules.SHDDataModule], [`NMNISTDataModule`][spikeckpt.data.modules.NMNISTDataModule] (Lightning data modules,
batches ``(x (T, B, ...) float32, y (B,) int64)``, or ``x`` a packed
[`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain] with ``packed=True``), [`write_synthetic_shd`][spikeckpt.data.synthetic.write_synthetic_shd],
[`write_synthetic_nmnist`][spikeckpt.data.synthetic.write_synthetic_nmnist], [`steps_for`][spikeckpt.data.frames.steps_for], [`DataNotFoundError`][spikeckpt.data.errors.DataNotFoundError] and
`DataFileError`.
"""

from __future__ import annotations

import importlib
from typing import Any

from spikeckpt.data.errors import DataExistsError, DataFileError, DataNotFoundError
from spikeckpt.errors import MissingDependencyError

_LAZY: dict[str, tuple[str, str]] = {
    "SHDDataModule": ("spikeckpt.data.modules", "tonic,lightning"),
    "NMNISTDataModule": ("spikeckpt.data.modules", "tonic,lightning"),
    "write_synthetic_shd": ("spikeckpt.data.synthetic", "tonic"),
    "write_synthetic_nmnist": ("spikeckpt.data.synthetic", "tonic"),
    "steps_for": ("spikeckpt.data.frames", "tonic"),
    "EventsToSpikes": ("spikeckpt.data.frames", "tonic"),
    "pad_time_first": ("spikeckpt.data.frames", "tonic"),
    "PackTimeFirst": ("spikeckpt.data.frames", "tonic"),
    "NMNIST": ("spikeckpt.data.datasets", "tonic"),
    "SHD": ("spikeckpt.data.datasets", "tonic"),
    "open_dataset": ("spikeckpt.data.datasets", "tonic"),
}

__all__ = [
    "DataExistsError",
    "DataFileError",
    "DataNotFoundError",
    "EventsToSpikes",
    "NMNIST",
    "NMNISTDataModule",
    "PackTimeFirst",
    "SHD",
    "SHDDataModule",
    "open_dataset",
    "pad_time_first",
    "steps_for",
    "write_synthetic_nmnist",
    "write_synthetic_shd",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'spikeckpt.data' has no attribute {name!r}")
    module, extras = _LAZY[name]
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:
        raise MissingDependencyError(
            f"spikeckpt.data.{name} needs the optional package {err.name!r}: "
            f'pip install "spikeckpt[{extras}]"',
            name=err.name,
        ) from err
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
