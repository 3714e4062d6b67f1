"""Parse and format byte counts ("512MiB", "2GB"). Pure Python."""

from __future__ import annotations

import math
import re

from spikeckpt.errors import ConfigError

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
#: Said when a share is given where bytes are read (``budget="25%"``, ``budget=0.25``).
_SHARE = (
    " (a share is not a budget here: MemoryBudget(fraction=0.25) takes a share of the free "
    "device memory; the command line's --budget 25% is a share of plain BPTT's need)"
)
_PATTERN = re.compile(r"^\s*([+-]?)\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
FORMATS = (
    "a whole number of bytes ('4096'), or a number with a unit: B; kB, MB, GB, TB (powers of "
    "1000); KiB, MiB, GiB, TiB or K, M, G, T (powers of 1024); units in any case, a space "
    "allowed, e.g. '512MiB', '2GB', '1.5 GiB'"
)
"""The accepted formats, in words (error messages quote it)."""


def parse_bytes(value: int | float | str) -> int:
    """Turn ``value`` into a whole number of bytes (``>= 0``).

    Accepts ints (bytes), floats that are whole numbers, and strings such as ``"512MiB"``,
    ``"2GB"``, ``"1.5 GiB"``, ``"4096"``. Decimal units (kB, MB, GB) are powers of 1000,
    binary units (KiB, MiB, GiB, and the bare K, M, G) powers of 1024.

    Raises:
        ValueError: the value is negative (the message says negative sizes and budgets are
            not allowed and what to write), not finite, not whole, or a string that does not
            parse (the message lists the accepted formats).
    """
    if isinstance(value, bool):
        raise ConfigError(f"a byte count must be a number or a string like '512MiB', not {value!r}")
    if isinstance(value, int):
        number, scale = float(value), 1
    elif isinstance(value, float):
        number, scale = value, 1
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None:
            share = _SHARE if value.strip().endswith("%") else ""
            raise ConfigError(f"cannot parse {value!r} as a byte count{share}: write {FORMATS}")
        unit = match.group(3).lower()
        if unit not in _UNITS:
            raise ConfigError(
                f"cannot parse {value!r} as a byte count: unknown unit {match.group(3)!r}; "
                f"write {FORMATS}"
            )
        number, scale = float(match.group(1) + match.group(2)), _UNITS[unit]
    else:
        raise ConfigError(
            f"a byte count must be an int or a string like '512MiB', not {value!r} "
            f"({type(value).__name__})"
        )
    if math.isnan(number) or math.isinf(number):
        raise ConfigError(f"a byte count must be finite, got {value!r}")
    if number < 0:
        shown = value.strip() if isinstance(value, str) else value
        positive = repr(shown.lstrip("-+ ")) if isinstance(shown, str) else f"{-shown:g}"
        raise ConfigError(
            f"a byte count cannot be negative, got {value!r}: negative sizes and budgets are "
            f"not allowed. Write the memory to allow, e.g. {positive} (MemoryBudget: "
            "or fraction=0.8 for a share of the free device memory)"
        )
    total = number * scale
    if (isinstance(value, float) or scale == 1) and not total.is_integer():
        # a plain number is bytes: "0.25" is no share and "1.5" no byte count (were 0 and 2)
        share = _SHARE if 0 < number <= 1 else ""
        raise ConfigError(f"a byte count must be a whole number of bytes, got {value!r}{share}")
    return int(round(total))


def available_host_bytes() -> int:
    """Available host RAM in bytes (``MemAvailable`` from /proc/meminfo, else sysconf)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def format_bytes(count: float) -> str:
    """Format a byte count with a binary unit, e.g. ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
