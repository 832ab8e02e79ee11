"""Byte sizes as people write them (``"300MiB"``, ``"2GB"``, ``"1TiB"``), read in one place.

The search's memory budget, the estimate's fit test and the CLI all take such sizes; one parser
keeps them agreeing on which units exist. A leaf module (it imports only the errors), so every
layer may use it.
"""

from __future__ import annotations

import re
from typing import Any

from composable_atorch.errors import ConfigError

#: decimal (kB, MB, GB, TB) and binary (KiB, MiB, GiB, TiB) units, matched case-insensitively
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(value: Any, field_name: str = "memory_limit", *, required: bool = False) -> int | None:
    """A positive number of bytes, or a string such as ``"300MiB"`` / ``"2GB"`` / ``"1TiB"``.

    ``None`` means "no limit" and comes back as None, unless ``required``; anything else that is not
    a size is a ConfigError naming ``field_name``.
    """
    if value is None and not required:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)\s*", value, flags=re.IGNORECASE)
        if m and m.group(2).upper() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    raise ConfigError(field_name, value, "a positive number of bytes or a string such as '300MiB', '2GB' or '1TiB'")
