"""``atorch.distributed.distributed``: ranks, sizes and groups as ATorch's helpers return them.

ATorch reads module globals its ``create_parallel_group`` filled; here the helpers read the
parallel context of the last plan ``auto_accelerate`` applied in this process (or of
:func:`create_parallel_group`). As in ATorch, a name the groups do not have gives None.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from composable_atorch.compat import groups
from composable_atorch.errors import ConfigError
from composable_atorch.runtime import mesh


def init_distributed(
    backend="nccl",
    coworker_num_per_node=0,
    elastic_or_fault_tolerant=False,
    set_cuda_device_using_local_rank=False,
    timeout=None,
) -> bool:
    """ATorch's ``init_distributed``: ``timeout`` is a ``datetime.timedelta`` (or seconds);
    ``set_cuda_device_using_local_rank`` selects the local GPU when there is one. nccl without a
    GPU falls back to gloo (the scripts say "nccl"; this library runs them on CPUs too). Coworkers
    and elastic restarts are ATorch's launcher's: a nonzero / True value is a ConfigError."""
    if coworker_num_per_node:
        raise ConfigError("init_distributed coworker_num_per_node", coworker_num_per_node, "0 (no coworkers here)")
    if elastic_or_fault_tolerant:
        raise ConfigError(
            "init_distributed elastic_or_fault_tolerant", True, "False: restart with torchrun's --max-restarts"
        )
    if backend == "nccl" and not torch.cuda.is_available():
        backend = "gloo"
    if isinstance(timeout, int | float) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout)
    return mesh.init_distributed(
        backend, timeout=timeout, set_cuda_device_using_local_rank=set_cuda_device_using_local_rank
    )


def reset_distributed() -> None:
    """Forget the groups and destroy the default process group (as ATorch's)."""
    destroy_parallel_group()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def world_size():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def local_rank():
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return int(os.environ.get("LOCAL_RANK", -1))


def create_parallel_group(parallel_config, use_atorch_pipe=False, use_device_mesh=False):
    """ATorch's ``([(name, size), ...], rank_order[, multiple_instances])``: makes and records the groups."""
    from composable_atorch.runtime.layout import plan_layout
    from composable_atorch.runtime.mesh import make_context

    groups_, order, multi = (list(parallel_config) + [None, False])[:3]
    world = world_size() or 1
    context = make_context(
        plan_layout(groups_, world, order, bool(multi)), "cuda" if torch.cuda.is_available() else "cpu"
    )
    groups.record(context)
    return context


def destroy_parallel_group(destroy_rpc=True) -> None:
    """Forget the recorded groups (the device mesh's groups live as long as the default group)."""
    groups.record(None)


def _dim(name: str):
    from composable_atorch.runtime.layout import DIM_ALIASES

    context = groups.current()
    name = DIM_ALIASES.get(name, name)
    if context is None or context.mesh is None or name not in context.layout.names:
        return None, None
    return context, name


def parallel_group(name):
    context, dim = _dim(name)
    return None if context is None else context.mesh[dim].get_group()


def parallel_group_size(name):
    context, dim = _dim(name)
    return None if context is None else context.layout.size(dim)


def parallel_rank(name):
    context, dim = _dim(name)
    return None if context is None else context.layout.coordinate(context.rank, dim)


def parallel_group_and_ranks(name):
    context, dim = _dim(name)
    if context is None:
        return None, None
    ranks = next(g for g in context.layout.groups(dim) if context.rank in g)
    return context.mesh[dim].get_group(), ranks


def parallel_instance_num():
    context = groups.current()
    return None if context is None else context.instance_num


def parallel_instance_index():
    context = groups.current()
    return None if context is None else context.instance_index


def get_data_partition_rank_and_size():
    """(this rank's data shard, number of shards) over ATorch's data and zero dimensions; (0, 1) without groups."""
    context = groups.current()
    if context is None:
        return 0, 1
    return context.data_rank, context.data_size


def is_distributed() -> bool:
    return (world_size() or 1) > 1
