"""``train_step``: the one call that trains every plan, pipeline or not.

    loss = train_step(model, optim, inputs, targets, loss_fn)

Without a pipeline it is the ordinary loop (``loss_fn(model(inputs), targets)``, the plan
optimizer's ``backward``, ``step``, ``zero_grad``) and returns this rank's loss. For a
pipeline-parallel plan the model is one stage; its schedule runs forward and backward over the
microbatches with the loss inside, and the step's mean loss (over the microbatches and the data
dimension) is returned on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Attribute a pipeline stage module carries: its runner, with ``step(inputs, targets, loss_fn) -> float``.
PIPELINE_ATTR = "_composable_atorch_pipeline"


def train_step(model: torch.nn.Module, optim, inputs, targets, loss_fn: Callable) -> float:
    """One optimizer step (or one micro-batch of an accumulation window); returns the loss."""
    runner = getattr(model, PIPELINE_ATTR, None)
    if runner is not None:
        loss = runner.step(inputs, targets, loss_fn)
    else:
        out = loss_fn(model(inputs), targets)
        if hasattr(optim, "backward"):
            optim.backward(out)
        else:
            out.backward()
        loss = float(out.detach())
    optim.step()
    optim.zero_grad()
    return loss
