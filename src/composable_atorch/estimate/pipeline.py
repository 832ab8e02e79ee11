"""Pipeline plans in the fake world: one simulated rank per stage, the stages' metadata handed on in stage order.

A pipeline plan returns one stage per rank, its runner on the plan's optimizer (``PlanOptimizer.runner``);
torch's schedule trains it, forward and backward over the micro-batches with the loss inside, so the
simulation drives that schedule instead of ``loss_fn(model, batch)``.

What torch's pipelining does on the fake process group (torch 2.13), and why the adapter below:

* the activations and gradients themselves travel by ``isend`` / ``irecv``: on the fake group these are
  no-ops, and the receive buffers are fake tensors the stage allocates from its metadata, of the very
  shapes the real run receives. That part runs as is and is counted as on the real run.
* before its first step the schedule runs a *vote* over P2P (is every stage's metadata static?) and
  reads the result with ``.item()``: a fake tensor has no value, and a fake ``recv`` receives nothing.
  No stage of this library's pipeline is built with static metadata, so on every real run the vote
  says "dynamic": :func:`schedule_step` sets that outcome on the stages in place of the vote.
* "dynamic" then sends each stage's output metadata to the next stage, and each stage's input-gradient
  metadata to the previous one, as pickled objects (``send_object_list`` / ``recv_object_list``);
  on the fake group the receiver gets nothing and cannot unpickle it. :class:`Mailbox` carries the
  forward metadata from the simulated stage ``s - 1`` to the simulated stage ``s`` (so the stages are
  simulated in stage order, one process, one at a time); the backward metadata a stage would receive
  is the gradient of what it sent: torch's own rule for plain tensors (``_derive_grad_metas``, the
  "static" mode's derivation). A stage boundary holding a DTensor has no such rule and is refused.

This is the smallest workaround found: torch's schedule, stages, buffers and P2P calls all run; only
the two metadata exchanges that carry *values* across ranks are answered from the other simulated
stages. Schedules that place several stages on one rank (interleaved, V) would need the metadata of a
stage simulated later (rank 0's second stage follows the last rank's first): refused for now.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

from composable_atorch.estimate.inputs import EstimateError

NEEDS_CRITERION = (
    "estimate(..., criterion=lambda output, targets: loss) and a batch of (inputs, targets) shapes: "
    "the plan is a pipeline, its loss runs inside the schedule on the last stage's output "
    "(as the search's Workload.criterion)"
)


@dataclass
class Mailbox:
    """Stage index -> the forward metadata that stage sent on (``_StageForwardMeta``)."""

    forward: dict[int, Any] = field(default_factory=dict)


def wire(runner, mailbox: Mailbox) -> None:
    """Answer the metadata exchanges of this rank's stages from the mailbox (see the module doc).

    One adapter for torch's private stage protocol (``PipelineStage._send_meta`` / ``_recv_meta``;
    torch 2.13), set on the stage instances only."""
    from torch.distributed.pipelining._utils import (
        _derive_grad_metas,
        _DTensorMeta,
        _StageBackwardMeta,
        _StageForwardMeta,
    )

    if len(runner.stages) != 1:
        raise EstimateError(
            f"the pipeline schedule {runner.schedule_name} places {len(runner.stages)} stages on one rank",
            "the simulation hands stage metadata on in stage order, one stage per rank",
            "estimate the plan with schedule='1F1B' or 'GPipe' (one stage per rank; the memory of the "
            "interleaved schedules is not simulated yet)",
        )

    for stage in runner.stages:

        def send_meta(self, meta, dst_stage):
            if isinstance(meta, _StageForwardMeta):
                mailbox.forward[self.stage_index] = meta

        def recv_meta(self, src_stage):
            if src_stage < self.stage_index:
                if src_stage not in mailbox.forward:
                    raise EstimateError(
                        f"stage {self.stage_index} is simulated before stage {src_stage}",
                        "its input metadata is what that stage sends",
                        "simulate the stages in order",
                    )
                return mailbox.forward[src_stage]
            outputs = self._stage_meta.outputs
            if any(isinstance(m, _DTensorMeta) for m in outputs):
                raise EstimateError(
                    f"pipeline stage {self.stage_index} sends a DTensor to the next stage",
                    "its gradient metadata cannot be derived without the next stage",
                    "let the stage boundary carry plain tensors (tensor parallel's use_local_output)",
                )
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(outputs))

        stage._send_meta = types.MethodType(send_meta, stage)
        stage._recv_meta = types.MethodType(recv_meta, stage)


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a pipeline batch; anything else is the typed error naming the fix."""
    if isinstance(batch, list | tuple) and len(batch) == 2:
        return batch[0], batch[1]
    raise EstimateError(
        "a pipeline plan trains on (inputs, targets) batches", f"got a {type(batch).__name__}", NEEDS_CRITERION
    )


def schedule_step(runner, inputs, targets, criterion) -> None:
    """One pass of the runner's schedule over the micro-batches, as ``runner.step`` does it minus the
    loss read back as a Python float (a fake tensor has no value; the loss scalars are not the cost)."""
    if inputs.size(0) % runner.microbatches:
        raise EstimateError(
            "the per-rank batch does not split into the pipeline's micro-batches",
            f"{inputs.size(0)} rows, {runner.microbatches} micro-batches",
            "give a global batch that is a multiple of data size x microbatches",
        )
    schedule = runner._schedule(criterion)  # the runner's schedule for this loss (built once, as in runner.step)
    schedule._warmup_p2p = _dynamic_vote  # the vote's outcome (module doc); torch 2.13's private hook, on this instance
    first, last = 0 in runner.local, runner.n_stages - 1 in runner.local
    losses: list = []
    runner.guard.running = True
    try:
        schedule.step(
            *((inputs,) if first else ()),
            return_outputs=False,
            **({"target": targets, "losses": losses} if last else {}),
        )
    finally:
        runner.guard.running = False


def _dynamic_vote(stages, has_backward, p2p_done) -> None:
    """What torch's warm-up vote concludes for stages built without static metadata: "dynamic"."""
    from torch.distributed.pipelining._utils import InferenceMode

    for stage in stages:
        stage._inference_mode = InferenceMode.DYNAMIC


def criterion_loss(criterion):
    """``loss_fn(model, batch)`` from ``criterion(output, targets)`` (batches of ``(inputs, targets)``),
    as :func:`composable_atorch.train_step` trains a plan without a pipeline."""

    def loss_fn(model, batch):
        inputs, targets = split_batch(batch)
        return criterion(model(inputs), targets)

    return loss_fn
