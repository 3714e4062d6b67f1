"""Argument types, help formatting and early checks shared by the subcommands.

Every value is checked while the command line is parsed, before anything slow runs: a bad
value ends the command at once with argparse's usage line and a message that names the fix.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spikeckpt.errors import ConfigError
from spikeckpt.units import format_bytes, parse_bytes

#: A word that is only a unit, as a shell splits ``--budget 1 GB`` or ``--budget 5 %``.
_UNIT_WORD = re.compile(r"^(%|[kKmMgGtT]i?[bB]?|[bB])$")
_NUMBER = re.compile(r"^[0-9]*\.?[0-9]+$")
_NEGATIVE = re.compile(r"^-[0-9.]")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (line breaks kept); every option's help ends with its default.

    Defaults that say nothing (None, False) are left out: the help says what happens then.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = all(action.default is not nothing for nothing in (None, False, argparse.SUPPRESS))
        if "%(default)" in text or not action.option_strings or not shown:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that catches values a shell split or took for an option.

    ``--budget 1 GB`` (unit split off), ``--budget -1MiB`` (argparse reads an option) and
    ``--budget 5 %`` would otherwise end with argparse's bare "unrecognized arguments" or
    "expected one argument". Options whose type is marked ``byte_valued`` are checked.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if args is not None:
            problem = split_value_problem(list(args), self._byte_options())
            if problem:
                self.error(problem)
        return super().parse_known_args(args, namespace)

    def _byte_options(self) -> set[str]:
        return {
            option
            for option, action in self._option_string_actions.items()
            if getattr(action.type, "byte_valued", False)
        }


def split_value_problem(argv: list[str], options: set[str]) -> str | None:
    """What is wrong when a byte-valued option's value was split or read as an option, or None."""
    for i, token in enumerate(argv):
        name, equals, value = token.partition("=")
        if name not in options:
            continue
        after = i + 1
        if not equals:
            if i + 1 >= len(argv):
                return None  # argparse says "expected one argument"
            value, after = argv[i + 1], i + 2
        if _NEGATIVE.match(value):
            return (
                f"argument {name}: {value!r} is negative; a budget or size must be positive, "
                f"e.g. {name} {value[1:]}"
            )
        if after < len(argv) and _NUMBER.match(value) and _UNIT_WORD.match(argv[after]):
            joined = value + argv[after]
            return (
                f"argument {name}: the value {value!r} is followed by {argv[after]!r}: write the "
                f"number and its unit as one word, {name} {joined}"
            )
    return None


def _whole_at_least(text: str, minimum: int, example: int) -> int:
    """``text`` as an integer >= ``minimum``, else argparse's error naming the fix."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number: write an integer >= {minimum}, e.g. {example}"
        ) from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    return _whole_at_least(text, 1, 100)


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number >= 0 (a seed)."""
    return _whole_at_least(text, 0, 0)


@dataclass(frozen=True)
class Budget:
    """A device budget given as bytes, or as a share of what plain BPTT needs."""

    bytes: int | None = None
    share: float | None = None  # in (0, 1]

    def resolve(self, bptt_bytes: int) -> int:
        """Bytes for this budget when plain BPTT needs ``bptt_bytes``."""
        if self.bytes is not None:
            return self.bytes
        assert self.share is not None
        return int(bptt_bytes * self.share)

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        return f"{100 * (self.share or 0):g}%"


def _parse_budget(text: str, *, percent: bool) -> Budget:
    stripped = text.strip()
    if stripped.endswith("%"):
        if not percent:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a byte count such as 8MiB here, not a percentage"
            )
        try:
            share = float(stripped[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise argparse.ArgumentTypeError(
                f"cannot parse {text!r} as a budget share: write a percentage in (0, 100], e.g. 25%"
            )
        return Budget(share=share / 100)
    try:
        count = parse_bytes(stripped)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"cannot parse budget {text!r}: {error}") from None
    if count <= 0:
        raise argparse.ArgumentTypeError(
            f"a budget must be positive, got {text!r}: write e.g. 64MiB"
            + (" or 25%" if percent else "")
        )
    return Budget(bytes=count)


def budget(text: str) -> Budget:
    """An argparse type: a positive byte count (``64MiB``) or a share of BPTT's need (``25%``)."""
    return _parse_budget(text, percent=True)


def byte_budget(text: str) -> int:
    """An argparse type: a positive byte count such as ``8MiB`` (no percentage)."""
    value = _parse_budget(text, percent=False).bytes
    assert value is not None
    return value


def byte_size(text: str) -> int:
    """An argparse type: a positive byte count (a state or a taped step)."""
    try:
        count = parse_bytes(text.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if count <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive byte count, got {text!r}")
    return count


_type: Any  # a function: it takes an attribute, which mypy's function type has no room for
for _type in (budget, byte_budget, byte_size):
    _type.byte_valued = True


# ------------------------------------------------------------------------------- folders


def folder_problem(path: Path) -> str | None:
    """What stops a command from writing into the folder ``path``, or None; creates nothing.

    A folder that exists must be writable; one that does not must be creatable: its nearest
    existing parent must be a writable folder, and making (and at once removing) the first
    missing folder must work (which also catches read-only and virtual file systems).
    """
    if path.exists():
        if not path.is_dir():
            return f"{path} is a file, not a folder"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"cannot write into {path}: no permission"
        return None
    first = path.absolute()
    while not first.parent.exists() and first.parent != first:
        first = first.parent
    parent = first.parent
    if not parent.is_dir():
        return f"cannot create {path}: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {path}: no permission to write in {parent}"
    try:
        first.mkdir()
    except FileExistsError:
        return None  # made meanwhile by someone else: there now
    except OSError as error:
        return f"cannot create {path}: {error.strerror or error} ({first})"
    first.rmdir()
    return None


def output_folder(text: str) -> Path:
    """An argparse type: a folder the command writes into (created when it first writes).

    Checked while parsing, before anything slow: it must be a folder, or creatable.
    """
    path = Path(text).expanduser()
    problem = folder_problem(path)
    if problem:
        raise argparse.ArgumentTypeError(f"{problem}: give a folder you can write to")
    return path


def data_folder(text: str) -> Path:
    """An argparse type: tonic's ``save_to`` folder; it may not exist yet, but is no file."""
    path = Path(text).expanduser()
    for part in (path, *path.absolute().parents):
        if part.exists():
            if not part.is_dir():
                raise argparse.ArgumentTypeError(
                    f"{part} is a file, not a folder: give the folder that holds (or is to hold) "
                    "the data set's folder, e.g. data for data/SHD"
                )
            break
    return path


# ------------------------------------------------------------------------------- devices

#: ``--device`` choices, the same in every command: ``gpu`` is another name for ``cuda``.
DEVICES = ("cpu", "cuda", "gpu")
DEVICE_HELP = "where to run: cpu, or cuda (also: gpu) for an NVIDIA GPU"


def check_device(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a ``--device`` value; imports torch only for a GPU.

    Raises:
        ValueError: the device is unknown, or a GPU is asked for and CUDA is not available.
    """
    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    if device == "cpu":
        return device
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"--device {device}: no CUDA GPU is available here (torch.cuda.is_available() is "
            "False); use --device cpu"
        )
    return "cuda"
