"""The storage tiers' front: `make_store` makes the tier a run asks for (device: references,
`spikeckpt.storage.device`; host: CPU RAM, packed, `spikeckpt.storage.host`; disk: files,
`spikeckpt.storage.disk`) and `check_storage` checks a tier and its folder once, up front.

Every tier implements ``spikeckpt.storage.base.StateStore`` and counts, in its ``Ledger``, the
bytes it holds (``ledger.add/remove(kind, nbytes)``) and, for host and disk, the bytes copied
into and out of it (``ledger.moved``). Counted bytes are payload bytes after packing (see
``spikeckpt.storage.codecs``); containers and file headers are not counted.

Keys are ints (state indices). ``put`` on a key already stored replaces it. ``get`` and
``prefetch`` of an unknown key raise ``KeyError``; ``drop`` of an unknown key does nothing.
After ``close`` the store holds nothing and ``put``/``get``/``prefetch`` raise.
"""

from __future__ import annotations

import os
import tempfile

import torch

from spikeckpt.errors import ConfigError, StorageError
from spikeckpt.storage.base import TIER_KINDS, Ledger, StateStore
from spikeckpt.storage.device import DeviceStore
from spikeckpt.storage.disk import DiskStore, _storage_error
from spikeckpt.storage.host import HostStore

__all__ = ["DeviceStore", "DiskStore", "HostStore", "check_storage", "make_store"]


#: What each tier is, for error messages (keys: ``TIER_KINDS``).
_TIER_MEANING = {
    "device": "keep checkpoints where they are computed",
    "host": "CPU RAM",
    "disk": "files",
}
#: Names people write for a tier, and the tier they mean.
_ALIASES = {
    "gpu": "device",
    "cuda": "device",
    "accelerator": "device",
    "cpu": "host",
    "ram": "host",
    "memory": "host",
    "file": "disk",
    "files": "disk",
    "ssd": "disk",
}


def check_storage(
    storage: object, directory: str | os.PathLike[str] | None = None, *, probe: bool = True
) -> None:
    """Check a ``storage`` / ``directory`` pair before anything runs (``wrap`` calls this).

    The rule: ``storage`` is one of ``TIER_KINDS``; ``directory`` is only for
    ``storage="disk"`` (given with another tier it is an error, never silently ignored); with
    ``"disk"`` it must be an existing folder this process can create files in (with
    ``probe=True`` a temporary file is made there and removed at once).

    Raises:
        ValueError: unknown tier (the message names the valid ones, and the tier meant for
            names like ``"gpu"``), or ``directory`` given with a tier other than ``"disk"``.
        StorageError: ``directory`` does not exist, is a file, or is not writable.
    """
    _check_kind(storage)
    if directory is None:
        return
    if not isinstance(directory, (str, os.PathLike)):
        raise ConfigError(
            f"directory must be a path (str or os.PathLike), got {type(directory).__name__}"
        )
    _check_directory_kind(str(storage), directory)
    path = os.fspath(directory)
    blocker = _file_above(path)
    if blocker is not None:
        raise StorageError(
            f"directory={path!r} cannot be a folder: {blocker!r} above it is a file: pass a "
            "folder whose parents are folders for the disk tier's files; or use "
            "storage='host' to keep checkpoints in RAM"
        )
    if not os.path.exists(path) and os.path.expanduser(path) != path:
        # os.makedirs(path), the advice below, would make a folder named '~' here
        raise StorageError(
            f"directory={path!r} does not exist: '~' is not expanded in a path: pass "
            f"os.path.expanduser({path!r}) ({os.path.expanduser(path)!r})"
        )
    if not os.path.exists(path):
        raise StorageError(
            f"directory={path!r} does not exist: create it first (e.g. os.makedirs({path!r})) "
            "or pass an existing folder for the disk tier's files; or use storage='host' to "
            "keep checkpoints in RAM"
        )
    if not os.path.isdir(path):
        raise StorageError(
            f"directory={path!r} is a file, not a folder: pass the folder in which the disk "
            "tier may create its own temporary folder"
        )
    if probe:
        try:
            handle, name = tempfile.mkstemp(prefix=".spikeckpt-probe-", dir=path)
        except OSError as exc:
            raise _storage_error(exc, path, 0, "create files in") from exc
        os.close(handle)
        os.remove(name)


def _file_above(path: str) -> str | None:
    """The nearest existing path above ``path`` when it is a file (None: a folder, or
    nothing exists up to the root)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        above = os.path.dirname(parent)
        if above == parent:
            return None
        parent = above
    return parent if not os.path.isdir(parent) else None


def _check_kind(kind: object) -> None:
    if isinstance(kind, str) and kind in TIER_KINDS:
        return
    names = ", ".join(map(repr, TIER_KINDS))
    meaning = "; ".join(f"{k}: {_TIER_MEANING[k]}" for k in TIER_KINDS)
    meant = _ALIASES.get(kind.lower()) if isinstance(kind, str) else None
    hint = f". For {kind!r} write storage={meant!r}" if meant else ""
    raise ConfigError(f"unknown storage {kind!r}: use one of {names} ({meaning}){hint}")


def _check_directory_kind(kind: str, directory: str | os.PathLike[str]) -> None:
    if kind != "disk":
        raise ConfigError(
            f"directory={os.fspath(directory)!r} only applies to storage='disk' (where the disk "
            f"tier puts its files), not storage={kind!r}: pass storage='disk' to keep "
            "checkpoints in files there, or drop directory="
        )


def make_store(
    kind: str,
    device: torch.device | str,
    ledger: Ledger,
    directory: str | os.PathLike[str] | None = None,
) -> StateStore:
    """Build the tier named ``kind`` (``"device"``, ``"host"`` or ``"disk"``) for ``device``.

    ``directory`` (disk only) is the folder under which the disk tier makes its own temporary
    folder (`check_storage` refuses one that does not exist before anything runs: a
    misspelt path is not made); default: the system temporary folder. Unknown tiers and a
    ``directory`` with another tier raise ``ValueError`` as in `check_storage`.
    """
    _check_kind(kind)
    if directory is not None:
        _check_directory_kind(kind, directory)
    if kind == "device":
        return DeviceStore(device, ledger)
    if kind == "host":
        return HostStore(device, ledger)
    return DiskStore(device, ledger, directory=directory)
