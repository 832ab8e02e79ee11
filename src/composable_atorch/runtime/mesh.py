"""The parallel context: a layout's device mesh and process groups, and what the axes tell each other.

    init_distributed("gloo")                                   # from torchrun's environment
    pc = create_parallel_group(([("tensor", 2), ("data", 2)], None))
    pc.mesh["tensor"], pc.data_group(), pc.loss_group()

:func:`make_context` builds the :class:`ParallelContext` a plan's ``parallel_mode`` leaves in
``TrainState.parallel``; ATorch's ``create_parallel_group`` returns the same object instead of
filling module globals (pass the same groups to ``parallel_mode`` and a plan builds the same mesh).

What one axis must tell another travels as typed fields of the context, derived once from the
layout where they can be (as torchtitan's ``ParallelDims`` names its loss and batch meshes): the
mesh the batch is split over, the group the reported loss is averaged over, which modules are
experts and over which mesh they replicate, and a registry of what was applied to which module.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from composable_atorch.errors import AlreadyAppliedError, ConfigError
from composable_atorch.runtime.layout import BATCH_DIMS, INSTANCE_DIM, SPLIT_DIMS, Layout, plan_layout


@dataclass(frozen=True)
class ExpertLayout:
    """What expert_parallel tells ddp, fsdp and the estimate: the experts modules it split (each rank holds
    other experts under the same names, so they are kept out of the expert x data replicas), and the mesh
    of the ranks that hold the same experts (the data dimension; None without one)."""

    modules: tuple[Any, ...]
    replica_mesh: Any = None

    @property
    def replicas(self) -> int:
        return 1 if self.replica_mesh is None else self.replica_mesh.size()


@dataclass(frozen=True)
class StageGradients:
    """How a pipeline splits the model's gradients over ranks, outside DTensor: each rank of
    ``group`` holds its own stages' parameters. ``held_by`` maps ``id(parameter)`` to how many ranks
    of the group hold that parameter in full (a tied embedding on the first and the last stage's
    ranks: 2; pieces every stage holds: the pipeline's size); absent means 1. A global gradient norm
    sums each rank's part over the group, counting such a parameter once; an inf/nan check reduces
    its verdict over the group, so every stage skips the same steps."""

    group: Any
    held_by: dict[int, int] = field(default_factory=dict)


@dataclass
class AppliedRegistry:
    """What was applied to which module, kept per module as torch's composable ``contract`` keeps it: a
    second application of one kind to the same module is refused (:class:`AlreadyAppliedError`)."""

    _entries: dict[int, tuple[Any, set[str]]] = field(default_factory=dict, repr=False)

    def record(self, kind: str, module: Any) -> None:
        _, kinds = self._entries.setdefault(id(module), (module, set()))
        if kind in kinds:
            raise AlreadyAppliedError(kind, module)
        kinds.add(kind)

    def kinds(self, module: Any) -> frozenset[str]:
        entry = self._entries.get(id(module))
        return frozenset(entry[1]) if entry is not None and entry[0] is module else frozenset()

    def modules(self, kind: str) -> list[Any]:
        return [m for m, kinds in self._entries.values() if kind in kinds]


@dataclass
class ParallelContext:
    """What parallel transforms share through ``TrainState.parallel``.

    ``mesh`` is None when no process group exists (a single process not launched by torchrun):
    then data-parallel transforms have nothing to synchronize and say so in the plan's report.
    ``grad_shard_group`` is set by a transform whose gradients are sharded outside DTensor
    (fairscale's ShardedDataParallel), so inf checks and clipping know to reduce over it.
    """

    layout: Layout
    rank: int = 0
    mesh: Any = None
    grad_shard_group: Any = None
    #: a pipeline's split of the gradients (None without one): clipping and inf/nan checks reduce over it
    stage_grads: StageGradients | None = None
    #: expert_parallel's split, for the data-parallel steps and the estimate (None without one)
    experts: ExpertLayout | None = None
    #: a sequence split's check of the loss function train_step trains with: ``check(loss_fn, output,
    #: inputs, targets)`` raises where the loss would not train the split as one process (None without one)
    loss_check: Callable | None = None
    #: what was applied to which module (see :class:`AppliedRegistry`)
    applied: AppliedRegistry = field(default_factory=AppliedRegistry)
    #: flattened sub-meshes by their dimension names, made once (flattening makes a process group)
    flat_meshes: dict[tuple[str, ...], Any] = field(default_factory=dict, repr=False)

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def data_size(self) -> int:
        return self.layout.batch_split

    @property
    def data_rank(self) -> int:
        return self.layout.batch_rank(self.rank)

    @property
    def instance_num(self) -> int:
        """ATorch's parallel_instance_num: independent copies of the layout in the world (1 without)."""
        return self.layout.size(INSTANCE_DIM)

    @property
    def instance_index(self) -> int:
        return self.layout.coordinate(self.rank, INSTANCE_DIM)

    @property
    def zero_size(self) -> int:
        """Size of the ``zero`` dimension (ZeRO sharding subgroups inside data parallelism; 1 without)."""
        return self.layout.size("zero")

    def dims(self, names) -> tuple[str, ...]:
        """The mesh's dimensions among ``names`` whose size is > 1, in the mesh's order."""
        return tuple(n for n in self.layout.mesh_dim_names if n in names and self.layout.size(n) > 1)

    def flat_mesh(self, names: tuple[str, ...]):
        """The 1-D mesh over ``names`` (one of them: its own; several: flattened once and kept, as torchtitan
        flattens dp_shard x cp; every rank must ask in the same order, since flattening makes a group)."""
        if len(names) == 1:
            return self.mesh[names[0]]
        if names not in self.flat_meshes:
            self.flat_meshes[names] = self.mesh[names]._flatten("_".join(names))
        return self.flat_meshes[names]

    def data_mesh(self):
        """The 1-D mesh over the batch dimensions (what DDP all-reduces and flat FSDP shards over):
        ``data``, or the batch dimensions > 1 (data x zero, data x expert) flattened into one."""
        if self.mesh is None:
            return None
        if self.mesh.ndim == 1:
            return self.mesh
        names = self.dims(BATCH_DIMS)
        return self.flat_mesh(names) if names else self.mesh["data"]

    def loss_dims(self) -> tuple[str, ...]:
        """The dimensions whose ranks hold different samples or tokens (batch x split dims > 1, within an
        instance): each rank's loss is the mean over its part, so the step's loss is their mean."""
        return self.dims((*BATCH_DIMS, *SPLIT_DIMS))

    def loss_group(self) -> tuple[Any, int]:
        """``(group, size)`` the reported loss is averaged over: the loss dimensions' group (None: the whole
        world, when they are every dimension > 1; ``size`` 1: nothing to average). Tensor and pipeline
        ranks compute one loss together, so they are left out; instances train apart, so they are too."""
        names = self.loss_dims()
        size = math.prod(self.layout.size(n) for n in names)
        if self.mesh is None or size == 1:
            return None, size
        if set(names) == set(self.dims(self.layout.mesh_dim_names)):
            return None, size
        return self.flat_mesh(names).get_group(), size

    def hybrid_mesh(self):
        """The 2-D ``(data, zero)`` = (replicate, shard) mesh torch's ``fully_shard`` takes for hybrid
        sharding (HSDP), or None when ``zero`` or ``data`` is 1 (nothing to replicate or to shard).

        Needs ``zero`` before ``data`` in ATorch's list (the mesh's data dimension before its zero one);
        the data-parallel transforms' contracts refuse the other order before any work."""
        if self.mesh is None or self.zero_size == 1 or self.layout.size("data") == 1:
            return None
        return self.mesh["data", "zero"]

    def zero_group(self):
        """The group sharding happens in: ``zero`` when it is > 1, else all batch ranks."""
        if self.mesh is None:
            return None
        if self.zero_size > 1:
            return (self.mesh if self.mesh.ndim == 1 else self.mesh["zero"]).get_group()
        return self.data_group()

    def data_group(self):
        mesh = self.data_mesh()
        return None if mesh is None else mesh.get_group()


def make_context(layout: Layout, device: str = "cpu") -> ParallelContext:
    """The context for this process: the device mesh if torch.distributed is initialized.

    The sub-meshes that need a group of their own are made here, on every rank, in one order: the
    batch mesh with an expert dimension, and the loss mesh when it is neither the world nor one dimension."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ParallelContext(layout=layout)
    if dist.get_world_size() != layout.world_size:
        raise ConfigError(
            "parallel layout world size", layout.world_size, f"the running world size {dist.get_world_size()}"
        )
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    names = layout.mesh_dim_names
    if layout.rank_order == tuple(range(layout.world_size)):
        mesh = init_device_mesh(device, layout.mesh_shape, mesh_dim_names=names)
    else:
        mesh = DeviceMesh(device, layout.mesh_tensor(), mesh_dim_names=names)
    pc = ParallelContext(layout=layout, rank=dist.get_rank(), mesh=mesh)
    if layout.size("expert") > 1 and mesh.ndim > 1:
        pc.data_mesh()
    pc.loss_group()
    return pc


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
