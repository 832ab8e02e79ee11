"""The bounded readers of data from elsewhere, where the core has always imported them from.

They live in :mod:`composable_atorch.untrusted` (a leaf module, so the hardware declarations below
the core read files the same way plans do); this module keeps ``composable_atorch.core.untrusted``
naming the same functions.
"""

from __future__ import annotations

from composable_atorch.untrusted import (
    MAX_DEPTH,
    MAX_JSON_BYTES,
    check_depth,
    json_depth,
    loads,
    read_regular_file,
    require_regular_file,
)

__all__ = [
    "MAX_DEPTH",
    "MAX_JSON_BYTES",
    "check_depth",
    "json_depth",
    "loads",
    "read_regular_file",
    "require_regular_file",
]
