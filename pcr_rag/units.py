"""Byte sizes: parse ``"2GiB"`` / ``"512MB"`` / ``1024`` into an int of bytes, and format bytes for humans.

Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) powers of 1000; a bare
``K``/``M``/``G``/``T`` is binary (as in ``dd`` and most config files). Sizes are never negative.
"""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Return ``value`` as a whole number of bytes; raise ``ValueError`` with the accepted forms otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return int(value)
    match = _PATTERN.match(str(value))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"not a byte size: {value!r}; use an int of bytes or a number with a unit such as "
            "'512MB', '2GiB', '1.5TB', '64K'"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(num: int | float) -> str:
    """Human-readable binary size, e.g. ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    size = float(num)
    sign = "-" if size < 0 else ""
    size = abs(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{sign}{size:.0f} {unit}" if unit == "B" else f"{sign}{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
