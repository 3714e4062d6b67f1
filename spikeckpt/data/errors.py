"""Errors of the data layer. Pure Python: importing this module imports neither tonic nor torch."""

from __future__ import annotations

from spikeckpt.errors import SpikeckptError


class DataExistsError(SpikeckptError, FileExistsError):
    """A folder that synthetic data would be written to already holds data spikeckpt did not
    write (refused: pick another root or delete them)."""


class DataNotFoundError(SpikeckptError, FileNotFoundError):
    """A dataset's files are not where tonic looks for them and could not be downloaded.

    The message names the folder tonic reads, the files it needs there, and how to write synthetic
    files in the same format instead (``spikeckpt data synth`` or ``synthetic=True``).
    """


class DataFileError(SpikeckptError, OSError):
    """A dataset's file is where tonic looks for it but cannot be read (e.g. not an HDF5 file).

    The message names the file, what is wrong with it and how to replace it.
    """
