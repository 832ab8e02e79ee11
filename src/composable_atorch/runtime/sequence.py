"""What a transform that runs the model needs to know about a sequence split (context parallelism,
Ulysses) installed before it, without importing it.

* :func:`probing`: a transform that checks the model by running it (pipeline_parallel compares
  each stage with the whole model on an example) enters it; the split's hooks read
  :func:`is_probing` and stay out of the way (no collectives, no positions), so the probe sees the
  model as one process runs it.
* :func:`mark_sequence_split` / :func:`sequence_split`: the group over which ranks hold different
  tokens of the same sequences. Each rank's loss is its part's mean; a transform that reports the
  loss itself (the pipeline's schedule) averages it over this group too.
* :func:`check_loss`: ``train_step`` hands the split the loss function it trains with, to be
  checked before the first step (a loss that shifts its targets inside itself trains a split wrongly).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import torch

_PROBING = contextvars.ContextVar("composable_atorch_probing", default=False)
#: attribute of the split model: ``(process group, size)``
SPLIT_GROUP_ATTR = "_composable_atorch_sequence_split_group"


@contextlib.contextmanager
def probing():
    token = _PROBING.set(True)
    try:
        yield
    finally:
        _PROBING.reset(token)


def is_probing() -> bool:
    return _PROBING.get()


class _Split:
    """The marker: a copy of the model (a probe's replica) gets none (a process group does not copy).
    ``check_loss(loss_fn, output, inputs, targets)``: the split's check of a loss function."""

    def __init__(self, group, size: int, check_loss: Callable | None = None):
        self.group, self.size, self.check_loss = group, size, check_loss

    def __deepcopy__(self, memo):
        return None


def mark_sequence_split(model: torch.nn.Module, group, size: int, check_loss: Callable | None = None) -> None:
    object.__setattr__(model, SPLIT_GROUP_ATTR, _Split(group, int(size), check_loss))


def check_loss(model: torch.nn.Module, loss_fn: Callable, output, inputs, targets) -> None:
    """The split's check of ``loss_fn`` on ``model``'s ``output`` for ``inputs`` (a typed error where the
    loss would not train the split as one process); nothing without a split."""
    split = getattr(model, SPLIT_GROUP_ATTR, None)
    if split is not None and split.check_loss is not None:
        split.check_loss(loss_fn, output, inputs, targets)


def sequence_split(model: torch.nn.Module) -> tuple | None:
    """``(group, size)`` of the sequence split installed on ``model``, or None."""
    split = getattr(model, SPLIT_GROUP_ATTR, None)
    return None if split is None else (split.group, split.size)
