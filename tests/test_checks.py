"""Argument checks shared by every entry point: byte counts (units) and storage/directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spikeckpt.errors import StorageError
from spikeckpt.storage import TIER_KINDS, check_storage
from spikeckpt.storage.base import Ledger
from spikeckpt.storage.tiers import make_store
from spikeckpt.units import parse_bytes

# ------------------------------------------------------------------------------ parse_bytes


@pytest.mark.parametrize("value", ["-5MiB", "-5 MiB", " -1GB", -5, -1.0, "-0.5KiB"])
def test_negative_byte_counts_say_negative_budgets_are_not_allowed(value: object) -> None:
    with pytest.raises(ValueError, match="cannot be negative") as info:
        parse_bytes(value)  # type: ignore[arg-type]
    message = str(info.value)
    assert "negative sizes and budgets are not allowed" in message
    assert "cannot parse" not in message
    assert "e.g." in message and "fraction=" in message  # what to write instead


def test_negative_string_suggests_its_positive_twin() -> None:
    with pytest.raises(ValueError, match="e.g. '5MiB'"):
        parse_bytes("-5MiB")


@pytest.mark.parametrize("value", ["abc", "", "MiB", "1.2.3GB"])
def test_unparsable_strings_list_the_accepted_formats(value: str) -> None:
    with pytest.raises(ValueError, match=f"cannot parse {value!r}") as info:
        parse_bytes(value)
    message = str(info.value)
    for unit in ("kB", "MB", "GB", "KiB", "MiB", "GiB", "powers of 1000", "powers of 1024"):
        assert unit in message


def test_unknown_unit_is_named() -> None:
    with pytest.raises(ValueError, match="unknown unit 'parsecs'"):
        parse_bytes("12 parsecs")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("+3k", 3072), ("-0", 0), ("1e3", 1000), ("0.5KiB", 512), (" 2 gb ", 2 * 10**9)],
)
def test_signs_exponents_and_spaces_still_parse(value: str, expected: int) -> None:
    assert parse_bytes(value) == expected


@pytest.mark.parametrize(("value", "share"), [("0.25", True), ("0.9", True), ("1.5", False)])
def test_a_plain_number_that_is_no_whole_byte_count_is_refused(value: str, share: bool) -> None:
    """A plain number is bytes: ``"0.25"`` (meant as a share) was read as 0 bytes, ``"1.5"``
    as 2; a unit keeps fractions (``"1.5 GiB"``)."""
    with pytest.raises(ValueError, match="whole number of bytes") as info:
        parse_bytes(value)
    assert ("fraction=0.25" in str(info.value)) == share
    assert parse_bytes("1.5 GiB") == 3 * 2**29


def test_a_budget_for_a_model_without_neurons_is_refused_clearly() -> None:
    """A stateless model (a neuron forgotten) under a budget: it was "state_bytes must be
    >= 1"; without a budget it runs, each step alone."""
    import torch
    from torch import nn

    import spikeckpt as sc

    ann = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))
    x = (torch.rand(30, 4, 20) < 0.1).float()
    with pytest.raises(sc.ConfigError, match="holds no state between time steps.*snn.Leaky"):
        sc.wrap(ann, plan="auto", budget="1MiB")(x)
    assert sc.wrap(ann)(x).shape == (30, 4, 4)


# ------------------------------------------------------------------------------ check_storage


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_valid_tiers_pass(kind: str) -> None:
    check_storage(kind)


@pytest.mark.parametrize(
    ("name", "meant"), [("gpu", "device"), ("CUDA", "device"), ("cpu", "host")]
)
def test_unknown_tier_names_the_valid_ones_and_the_one_meant(name: str, meant: str) -> None:
    with pytest.raises(ValueError, match="'device', 'host', 'disk'") as info:
        check_storage(name)
    assert f"storage={meant!r}" in str(info.value)


@pytest.mark.parametrize("name", ["tape", None, 3])
def test_unknown_tier_without_a_guess(name: object) -> None:
    with pytest.raises(ValueError, match="unknown storage") as info:
        check_storage(name)
    assert "write storage=" not in str(info.value)


@pytest.mark.parametrize("kind", ["host", "device"])
def test_directory_with_a_tier_that_does_not_use_it_is_an_error(kind: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only applies to storage='disk'") as info:
        check_storage(kind, tmp_path)
    assert "pass storage='disk'" in str(info.value) and "drop directory=" in str(info.value)
    with pytest.raises(ValueError, match="only applies to storage='disk'"):  # one rule
        make_store(kind, "cpu", Ledger(), directory=tmp_path)


def test_disk_directory_must_exist_be_a_folder_and_be_writable(tmp_path: Path) -> None:
    check_storage("disk", tmp_path)
    check_storage("disk", str(tmp_path))
    assert os.listdir(tmp_path) == []  # the probe file is gone
    missing = tmp_path / "no" / "such"
    with pytest.raises(StorageError, match="does not exist") as info:
        check_storage("disk", missing)
    assert "os.makedirs" in str(info.value) and not missing.exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(StorageError, match="is a file, not a folder"):
        check_storage("disk", a_file)
    # below a file: the message names the file (os.makedirs, the other fix, would fail)
    with pytest.raises(StorageError, match=r"a-file'? above it is a file") as below:
        check_storage("disk", a_file / "checkpoints" / "run")
    assert "os.makedirs" not in str(below.value)
    with pytest.raises(ValueError, match="must be a path"):
        check_storage("disk", 42)  # type: ignore[arg-type]


def test_disk_directory_with_a_tilde_names_expanduser(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``directory="~/ckpt"`` (an existing ``$HOME/ckpt``) was refused as missing, with the
    advice ``os.makedirs('~/ckpt')``, which makes a folder named ``~`` in the working folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(StorageError, match=r"'~' is not expanded.*os\.path\.expanduser") as info:
        check_storage("disk", "~/ckpt")
    assert "os.makedirs" not in str(info.value) and str(tmp_path / "ckpt") in str(info.value)
    check_storage("disk", os.path.expanduser("~/ckpt"))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_directory_is_a_storage_error(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(StorageError, match="not writable"):
            check_storage("disk", folder)
    finally:
        folder.chmod(0o700)


def test_unwritable_directory_is_a_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs as root too: the probe's failure is simulated at the OS call."""
    import errno
    import tempfile

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(StorageError, match="not writable") as info:
        check_storage("disk", tmp_path)
    assert "directory=" in str(info.value)
