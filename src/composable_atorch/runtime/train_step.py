"""``train_step``: the one call that trains every plan, pipeline or not.

    loss = train_step(model, optim, inputs, targets, loss_fn)

Without a pipeline it is the ordinary loop (``loss_fn(model(inputs), targets)``, the plan
optimizer's ``backward``, ``step``, ``zero_grad``); a model whose sequences are split over ranks
(context parallelism, Ulysses) first has ``loss_fn`` checked on the forward's output
(the split's ``ParallelContext.loss_check``: a loss that shifts its targets inside itself is refused
before the step). For a pipeline-parallel plan the model is one
stage; its schedule runs forward and backward over the microbatches with the loss inside.

Either way it returns the step's *mean* loss over the ranks that hold different samples or tokens,
the same float on every rank: what one process would report for the global batch (each such rank's
loss is the mean over its equal share). Why here: the user's loop prints / logs / early-stops on this
value, and a rank-local loss would make ranks disagree (and make a non-last pipeline stage report 0).

What it needs travels with the triple, typed, on the plan's optimizer (:class:`PlanOptimizer`): the
parallel context, whose :meth:`~composable_atorch.runtime.mesh.ParallelContext.loss_group` is derived
once from the layout (batch x sequence-split dimensions, within an instance), and the runner a
pipeline transform returned (``step(inputs, targets, loss_fn) -> float``), which drives the schedule
and averages over the same group itself. A plan without a parallel context under an initialized
process group averages over the world; a plain ``torch.optim`` optimizer (no plan) keeps the
rank-local loss: no collective is issued, so a reference run on one rank never waits for the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from composable_atorch.runtime.optim import PlanOptimizer, StepRunner


def runner_of(optim) -> StepRunner | None:
    """The pipeline runner the plan's optimizer carries, or None (no plan, or no pipeline)."""
    return optim.runner if isinstance(optim, PlanOptimizer) else None


def _loss_group(optim) -> tuple | None:
    """``(group, size)`` the loss is averaged over (see the module docstring), or None for a rank-local loss."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not isinstance(optim, PlanOptimizer):
        return None
    if optim.parallel is not None:
        return optim.parallel.loss_group()
    return None, dist.get_world_size()


def _start_data_mean(optim, loss: torch.Tensor):
    """Start averaging the loss over the loss group; ``finish()`` of the result gives the float.

    Started before the backward and finished after the step, asynchronously: a blocking all-reduce
    after the step made every rank wait there for the slowest one's optimizer step (measured
    ~1-3% of a small bf16 DDP step on the CPU). Every rank starts it at the same point of the step,
    so its place in each group's order of collectives is the same on all of them.
    """
    where = _loss_group(optim)
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


def _check_loss(optim, loss_fn: Callable, output, inputs, targets) -> None:
    """The sequence split's check of ``loss_fn`` (a typed error where it would not train the split as one process)."""
    check = optim.parallel.loss_check if isinstance(optim, PlanOptimizer) and optim.parallel is not None else None
    if check is not None:
        check(loss_fn, output, inputs, targets)


def train_step(model: torch.nn.Module, optim, inputs, targets, loss_fn: Callable) -> float:
    """One optimizer step (or one micro-batch of an accumulation window); returns the step's mean loss."""
    runner = runner_of(optim)
    if runner is not None:
        loss = runner.step(inputs, targets, loss_fn)
        optim.step()
        optim.zero_grad()
        return loss
    output = model(inputs)
    _check_loss(optim, loss_fn, output, inputs, targets)
    out = loss_fn(output, targets)
    del output  # the backward keeps what it needs of the model's output, not the whole of it
    finish = _start_data_mean(optim, out.detach())
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
