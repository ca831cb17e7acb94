"""Sizes in bytes as users write them: 1073741824, 5e8, "512MiB", "1.5GiB", "2GB", "64 KiB".

Binary units (KiB, MiB, GiB, TiB: powers of 1024) and decimal ones (KB, MB, GB, TB: powers of
1000), case-insensitive, B optional after the letter ("1g" is 1 GiB, as `ls -h` and torch write it)."""

from __future__ import annotations

import math
import re
from typing import Any

_UNITS = {"": 1, "b": 1,
          "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.I)


def parse_size(value: Any) -> int | None:
    """`value` in bytes, or None when it is not a size (a bool, a negative or zero number, a
    fraction of a byte, an unknown unit, anything else)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value >= 1 and value.is_integer() else None
    if not isinstance(value, str):
        return None
    m = _SIZE.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        return None
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    return int(n) if n >= 1 and n.is_integer() else None


def size_problem(field: str, value: Any) -> str | None:
    """The one-line problem when `value` is not a size, naming `field` and the fix; else None."""
    if parse_size(value) is not None:
        return None
    return (f"{field}={value!r}: not a size. Give bytes (1073741824, 5e8) or a number with a unit "
            "(512MiB, 1GiB, 2GB).")


def human_size(n: int) -> str:
    """1073741824 -> '1 GiB', 1536 -> '1.5 KiB', 5e8 -> '476.8 MiB' (binary units)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.1f} {unit}".replace(".0 ", " ") if unit != "B" else f"{int(x)} B"
        x /= 1024
    raise AssertionError("unreachable")
