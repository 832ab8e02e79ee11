"""What every parallel axis shares at apply time: the parallel context, the gradient-sync roles,
gradient averaging over a group of ranks and the broadcast of a module's local tensors.

Data parallelism averages over the batch dimensions; a pipeline stage over its data replicas; a
sequence split over the ranks that hold parts of the same sequences; tensor parallelism starts
every rank from the first rank's weights. Each uses these helpers over its own group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from composable_atorch.core.transform import TrainState
from composable_atorch.errors import RequirementError
from composable_atorch.runtime.mesh import ParallelContext
from composable_atorch.runtime.optim import OptimizerHook

#: The role every engine that synchronizes gradients owns (exactly one per plan).
GRAD_SYNC = "grad_sync"
#: The role of whoever shards the optimizer state.
OPTIMIZER_STATE_SHARDING = "optimizer_state_sharding"


def parallel_context(state: TrainState, who: str) -> ParallelContext:
    """The context parallel_mode left in the state; RequirementError if the plan had none."""
    if not isinstance(state.parallel, ParallelContext):
        raise RequirementError(
            who,
            "parallel_mode earlier in the plan",
            f"compose {who} with parallel_mode(...) (compose() adds it unless strict)",
        )
    return state.parallel


def broadcast_local(module: nn.Module, group) -> None:
    """Make every rank of ``group`` start from its first rank's parameters and buffers (DTensors: their shards)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t._local_tensor if hasattr(t, "_local_tensor") else t.data, group=group, group_src=0)


class DataGradSync(OptimizerHook):
    """Average a module's gradients over a group of ranks before the step (DTensor gradients: their local shards).

    The group is whatever the caller's ranks share the gradient of: the data replicas of a pipeline
    stage or a tensor-parallel model, the ranks of a sequence split."""

    def __init__(self, module: nn.Module, group, size: int):
        self.module, self.group, self.size = module, group, size

    def before_step(self, optimizer):
        from torch.distributed.tensor import DTensor

        for p in self.module.parameters():
            if p.grad is not None:
                g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(g, group=self.group)
                g.div_(self.size)
