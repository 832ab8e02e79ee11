"""ATorch's ``init_distributed(backend)`` and ``create_parallel_group(groups)`` on the same layout.

    init_distributed("gloo")                                   # from torchrun's environment
    pc = create_parallel_group(([("tensor", 2), ("data", 2)], None))
    pc.mesh["tensor"], pc.data_group()

``create_parallel_group`` returns the :class:`~composable_atorch.runtime.layout.ParallelContext`
(the device mesh with dimensions named from the groups) instead of filling module globals; pass
the same groups to ``parallel_mode`` and a plan builds the same mesh.
"""

from __future__ import annotations

import os

from composable_atorch.errors import ConfigError
from composable_atorch.runtime.layout import ParallelContext, make_context, plan_layout

BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def init_distributed(
    backend: str = "gloo",
    *,
    timeout_s: float | None = None,
    timeout=None,
    set_cuda_device_using_local_rank: bool = False,
) -> bool:
    """Initialize the default process group from torchrun's environment; True if it exists now.

    Already initialized: nothing happens but the timeout (below). No ``WORLD_SIZE`` in the
    environment (not launched): a single process, returns False. ATorch's keywords: ``timeout`` (a
    ``datetime.timedelta``, as torch takes it) and ``set_cuda_device_using_local_rank`` (select GPU
    ``LOCAL_RANK``, when there is one).

    The timeout bounds every collective (default ``launch --timeout`` or 300 s, not gloo's 30
    minutes), and a heartbeat names a rank that stopped responding and ends this one
    (:mod:`composable_atorch.runtime.liveness`).
    """
    import datetime

    import torch
    import torch.distributed as dist

    from composable_atorch.runtime.liveness import collective_timeout, watch

    if backend not in BACKENDS:
        raise ConfigError("init_distributed backend", backend, ", ".join(BACKENDS))
    if timeout is not None and timeout_s is not None:
        raise ConfigError("init_distributed timeout", timeout, "one of timeout (a timedelta) and timeout_s")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise ConfigError("init_distributed timeout", timeout, "a datetime.timedelta (or timeout_s in seconds)")
    if timeout is not None:
        timeout_s = timeout.total_seconds()
    if set_cuda_device_using_local_rank and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    seconds = collective_timeout(timeout_s)
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            return False
        _init_default_group(backend, datetime.timedelta(seconds=seconds))
    watch(timeout_s)
    return True


#: default groups :func:`init_distributed` made in this process (every rank makes its groups alike)
_groups_made = 0


def _init_default_group(backend: str, timeout) -> None:
    """torch's ``env://`` rendezvous, each group on its own key prefix of the store.

    Why the prefix: torch's ``env://`` store on rank 0 is multi-tenant, so a new group in the same
    process reuses the old server whenever anything still holds the destroyed group (a model DDP or
    FSDP wrapped, a device mesh, a plan's result), and every default group writes the same
    ``default_pg`` keys. The new rendezvous then read the old group's addresses, and one rank hung in
    ``init_process_group`` (ATorch's ``reset_distributed(); init_distributed()`` in one process, as
    its tests do). A prefix per group makes the old keys unreachable; the rest is torch's own (the
    agent's store under torchrun, libuv, timeouts).
    """
    global _groups_made
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", timeout=timeout))
    _groups_made += 1
    store = dist.PrefixStore(f"composable_atorch/group/{_groups_made}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def create_parallel_group(groups, device: str = "cpu") -> ParallelContext:
    """ATorch's ``(groups, rank_order)`` (or just ``groups``) -> the context with its device mesh."""
    import torch.distributed as dist

    rank_order = None
    if (
        isinstance(groups, tuple)
        and len(groups) == 2
        and (groups[1] is None or isinstance(groups[1], list | tuple))
        and isinstance(groups[0], list | tuple)
        and groups[0]
        and isinstance(groups[0][0], list | tuple)
    ):
        groups, rank_order = groups
    world = dist.get_world_size() if dist.is_initialized() else 1
    return make_context(plan_layout(groups, world, rank_order), device)
