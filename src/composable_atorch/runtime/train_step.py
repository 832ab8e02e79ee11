"""``train_step``: the one call that trains every plan, pipeline or not.

    loss = train_step(model, optim, inputs, targets, loss_fn)

Without a pipeline it is the ordinary loop (``loss_fn(model(inputs), targets)``, the plan
optimizer's ``backward``, ``step``, ``zero_grad``); a model whose sequences are split over ranks
(context parallelism, Ulysses) first has ``loss_fn`` checked on the forward's output
(:func:`composable_atorch.runtime.sequence.check_loss`: a loss that shifts its targets inside itself
is refused before the step). For a pipeline-parallel plan the model is one
stage; its schedule runs forward and backward over the microbatches with the loss inside.

Either way it returns the step's *mean* loss over the data dimension, the same float on every
rank: what one process would report for the global batch (each data rank's loss is the mean over
its equal share of the batch). Why here: the user's loop prints / logs / early-stops on this value,
and a rank-local loss would make ranks disagree (and make a non-last pipeline stage report 0).
Which group to average over:

* a pipeline stage's runner averages over the microbatches, broadcasts from the last stage and
  averages over the data dimension itself;
* a model marked by a model-parallel transform (:data:`LOSS_GROUP_ATTR`: ``(group, size)``, set
  from the plan's parallel context) averages over that data group;
* any other model trained with a plan's optimizer under an initialized process group averages
  over the world: every rank of one data shard holds the same loss (tensor / pipeline ranks
  compute it together), so the world mean *is* the mean over the data dimension.

A plain ``torch.optim`` optimizer (no plan) keeps the rank-local loss: no collective is issued,
so a reference run on one rank never waits for the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from composable_atorch.runtime.sequence import check_loss

#: Attribute a pipeline stage module carries: its runner, with ``step(inputs, targets, loss_fn) -> float``.
PIPELINE_ATTR = "_composable_atorch_pipeline"
#: Attribute a model-parallel transform sets on the model: ``(data process group or None, data size)``.
LOSS_GROUP_ATTR = "_composable_atorch_loss_group"


def mark_loss_group(model: torch.nn.Module, group, size: int) -> None:
    """Record over which data group :func:`train_step` averages this model's loss (a plain attribute)."""
    object.__setattr__(model, LOSS_GROUP_ATTR, (group, int(size)))


def _loss_group(model, optim) -> tuple | None:
    """``(group, size)`` the loss is averaged over (see the module docstring), or None for a rank-local loss."""
    import torch.distributed as dist

    from composable_atorch.runtime.optim import PlanOptimizer

    if not (dist.is_available() and dist.is_initialized()):
        return None
    marked = getattr(model, LOSS_GROUP_ATTR, None)
    if marked is not None:
        return marked
    if isinstance(optim, PlanOptimizer):
        return None, dist.get_world_size()
    return None


def _start_data_mean(model, optim, loss: torch.Tensor):
    """Start averaging the loss over the data dimension; ``finish()`` of the result gives the float.

    Started before the backward and finished after the step, asynchronously: a blocking all-reduce
    after the step made every rank wait there for the slowest one's optimizer step (measured
    ~1-3% of a small bf16 DDP step on the CPU). Every rank starts it at the same point of the step,
    so its place in each group's order of collectives is the same on all of them.
    """
    where = _loss_group(model, optim)
    if hasattr(loss, "full_tensor") and where is not None:  # a loss computed on DTensors (vocabulary-parallel)
        loss = loss.full_tensor()
    if where is None or where[1] <= 1:
        return lambda: float(loss)  # read after the step: no device sync between forward and backward
    import torch.distributed as dist

    group, size = where
    value = loss.detach().float().clone().reshape(())
    work = dist.all_reduce(value, group=group, async_op=True)

    def finish() -> float:
        work.wait()
        return float(value) / size

    return finish


def train_step(model: torch.nn.Module, optim, inputs, targets, loss_fn: Callable) -> float:
    """One optimizer step (or one micro-batch of an accumulation window); returns the step's mean loss."""
    runner = getattr(model, PIPELINE_ATTR, None)
    if runner is not None:
        loss = runner.step(inputs, targets, loss_fn)
        optim.step()
        optim.zero_grad()
        return loss
    output = model(inputs)
    check_loss(model, loss_fn, output, inputs, targets)
    out = loss_fn(output, targets)
    del output  # the backward keeps what it needs of the model's output, not the whole of it
    finish = _start_data_mean(model, optim, out.detach())
    try:
        if hasattr(optim, "backward"):
            optim.backward(out)
        else:
            out.backward()
        optim.step()
        optim.zero_grad()
    finally:  # also when the step raises (NonFiniteError): the other ranks complete the same all-reduce
        loss = finish()
    return loss
