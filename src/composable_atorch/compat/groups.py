"""The parallel context ATorch's module-level helpers read (``atorch.distributed.parallel_group_size``...).

ATorch keeps its process groups in module globals, and its users call small helpers on them
everywhere. The library passes the context explicitly (``TrainState.parallel``); for the ATorch
namespace only, the facade records the context of the last plan it applied (or of
``create_parallel_group``) here, per process, so those helpers have something to read.
"""

from __future__ import annotations

from typing import Any

_CURRENT: dict[str, Any] = {"context": None}


def record(context) -> None:
    """Remember ``context`` (a ParallelContext, or None to forget) as this process's groups."""
    _CURRENT["context"] = context


def current():
    """The recorded ParallelContext, or None before any plan made groups (or after destroy)."""
    return _CURRENT["context"]
