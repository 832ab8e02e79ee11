"""What ``train_step`` drives for a pipeline plan: this rank's stages and one of torch's schedules.

:class:`PipelineRunner` holds this rank's ``PipelineStage`` objects and builds a schedule per loss
function; :meth:`~PipelineRunner.step` runs forward and backward over the micro-batches with the loss
inside and returns the step's mean loss: broadcast from the last stage, averaged over the parallel
context's loss group (the data replicas and a sequence split's ranks). The pipeline transform returns
it in ``TrainState.runner``; it travels on the plan's optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from composable_atorch.errors import ConfigError
from composable_atorch.transforms.parallel.pipeline.stages import StageGuard

#: schedule name -> (torch class name, stage placement: "single" | "loop" | "v")
SCHEDULES = {
    "GPipe": ("ScheduleGPipe", "single"),
    "1F1B": ("Schedule1F1B", "single"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v"),
    "DualPipeV": ("ScheduleDualPipeV", "v"),
}
#: schedules that split the backward into input and weight passes (torch refuses compiled stages)
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def stage_ranks(schedule: str, pp: int, per_rank: int) -> dict[int, int]:
    """stage index -> pipeline rank, as torch's multi-stage schedules place them."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    style = SCHEDULES[schedule][1]
    return generate_stage_to_rank_mapping(pp, pp * per_rank, style="v" if style == "v" else "loop")


class PipelineRunner:
    """What train_step drives: this rank's PipelineStage(s) and a schedule per loss function."""

    def __init__(
        self,
        stages: list,
        n_stages: int,
        local: list[int],
        last_rank: int,
        microbatches: int,
        schedule: str,
        pp_group,
        loss_group: tuple,
        shared: list | None = None,
        an=None,
        main: str = "",
        guard: StageGuard | None = None,
    ):
        self.stages, self.n_stages, self.local, self.last_rank = stages, n_stages, local, last_rank
        #: parameters two of this rank's stages both use (a tied weight on a V's first and last stage):
        #: torch's schedule would divide their gradients by the microbatches once per stage; scaled here once
        self.shared = shared
        #: the cut's Anatomy (its ``carry``: the batch's inputs besides ``main`` the stages hand on)
        self.an, self.main = an, main
        self.microbatches, self.schedule_name = microbatches, schedule
        #: ``(group, size)`` the reported loss is averaged over: the parallel context's loss group (the data
        #: replicas and a sequence split installed before the cut: their ranks' losses are parts of one)
        self.pp_group, self.loss_group = pp_group, loss_group
        #: the stage's forward refuses outside the schedule once armed (the plain loop would run one stage)
        self.guard = guard or StageGuard()
        self.guard.armed = True
        self._schedules: dict[int, Any] = {}

    @property
    def running(self) -> bool:
        return self.guard.running

    def _schedule(self, loss_fn):
        from torch.distributed.pipelining import schedules

        key = id(loss_fn)
        if key not in self._schedules:
            cls_name, placement = SCHEDULES[self.schedule_name]
            cls = getattr(schedules, cls_name)
            stages = self.stages[0] if placement == "single" else self.stages
            scale = {"scale_grads": False} if self.shared else {}
            self._schedules[key] = (cls(stages, n_microbatches=self.microbatches, loss_fn=loss_fn, **scale), loss_fn)
        return self._schedules[key][0]

    def _inputs(self, inputs) -> tuple:
        """The first stage's positional inputs: the tensor, or a batch dict's main input and then the
        inputs the stages carry (an attention mask, token types: every rank reads their names from
        its own copy of the batch)."""
        if isinstance(inputs, dict):
            if self.an is None:
                raise ConfigError("pipeline inputs", sorted(inputs), "a tensor for the built-in GPT")
            main = self.main or next(iter(inputs))
            if main not in inputs:
                raise ConfigError("pipeline inputs", sorted(inputs), f"a dict holding the model's input {main!r}")
            self.an.carry[:] = [k for k in inputs if k != main and inputs[k] is not None]
            tensors = (inputs[main], *(inputs[k] for k in self.an.carry))
        else:
            if self.an is not None:
                self.an.carry[:] = []
            tensors = (inputs,)
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.size(0) % self.microbatches:
                raise ConfigError(
                    "pipeline batch",
                    tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__,
                    f"tensors whose batch size is a multiple of microbatches={self.microbatches}",
                )
        return tensors

    def step(self, inputs, targets, loss_fn) -> float:
        """Forward and backward of one global (per data rank) batch; the mean loss on every rank."""
        tensors = self._inputs(inputs)
        schedule = self._schedule(loss_fn)
        losses: list[torch.Tensor] = []
        first, last = 0 in self.local, self.n_stages - 1 in self.local
        args = tensors if first else ()
        kwargs = {"target": targets, "losses": losses} if last else {}
        self.guard.running = True
        try:
            schedule.step(*args, return_outputs=False, **kwargs)
        finally:
            self.guard.running = False
        for p in self.shared or ():
            if p.grad is not None:
                p.grad.div_(self.microbatches)
        mean = torch.stack([v.detach().float() for v in losses]).mean() if losses else torch.zeros(())
        dist.broadcast(mean, group=self.pp_group, group_src=self.last_rank)
        group, size = self.loss_group
        if size > 1:
            dist.all_reduce(mean, group=group)
            mean /= size
        return float(mean)
