"""What every axis offers the search: a ``parallel_mode`` layout with its dimension and the steps that use it.

Each axis proposes its own degrees from ``candidates()`` (context, Ulysses, expert, hybrid sharding); the
layout they share is built here, below the axes, so no axis imports another's package for it.
"""

from __future__ import annotations

from composable_atorch.core.context import LayoutOption
from composable_atorch.core.transform import lookup


def layout_option(dim: str, n: int, world: int, label: str, *steps, admit=None) -> LayoutOption:
    """The search's option of ``steps`` over ``dim`` of ``n``, the data dimension the rest of ``world``."""
    layout = lookup("parallel_mode")(groups=((dim, n), ("data", world // n)))
    return LayoutOption(label, layout, tuple(steps), dim, n, admit)
