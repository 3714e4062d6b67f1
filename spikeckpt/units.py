"""Parse and format byte counts ("512MiB", "2GB"). Pure Python."""

from __future__ import annotations

import math
import re

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
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Turn ``value`` into a whole number of bytes.

    Accepts ints (bytes), floats that are whole numbers, and strings such as ``"512MiB"``,
    ``"2GB"``, ``"1.5 GiB"``, ``"4096"``. Decimal units (kB, MB, GB) are powers of 1000,
    binary units (KiB, MiB, GiB, and the bare K, M, G) powers of 1024.

    Raises:
        ValueError: the value is negative, not finite, or a string that does not parse.
    """
    if isinstance(value, bool):
        raise ValueError(f"a byte count must be a number or a string like '512MiB', not {value!r}")
    if isinstance(value, int):
        number, scale = float(value), 1
    elif isinstance(value, float):
        number, scale = value, 1
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot parse {value!r} as a byte count: write a number with an optional unit, "
                "e.g. '512MiB', '2GB', '1.5GiB' or '4096'"
            )
        number, scale = float(match.group(1)), _UNITS[unit]
    else:
        raise ValueError(f"a byte count must be an int or a string like '512MiB', not {value!r}")
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"a byte count must be finite and non-negative, got {value!r}")
    total = number * scale
    if isinstance(value, float) and not total.is_integer():
        raise ValueError(f"a byte count must be a whole number of bytes, got {value!r}")
    return int(round(total))


def format_bytes(count: float) -> str:
    """Format a byte count with a binary unit, e.g. ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
