"""What a transform that runs the model needs to know about a sequence split (context parallelism,
Ulysses) installed before it, without importing it.

:func:`probing`: a transform that checks the model by running it (pipeline_parallel compares each
stage with the whole model on an example) enters it; the split's hooks read :func:`is_probing` and
stay out of the way (no collectives, no positions), so the probe sees the model as one process runs
it. (The group a split's loss is averaged over, and its check of the loss function, travel in the
parallel context: ``ParallelContext.loss_group()`` and ``loss_check``.)
"""

from __future__ import annotations

import contextlib
import contextvars

_PROBING = contextvars.ContextVar("composable_atorch_probing", default=False)


@contextlib.contextmanager
def probing():
    token = _PROBING.set(True)
    try:
        yield
    finally:
        _PROBING.reset(token)


def is_probing() -> bool:
    return _PROBING.get()
