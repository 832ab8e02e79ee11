"""Data parallelism: ``parallel_mode`` (process groups + distributed sampler), ``ddp`` and ``zero1``.

Who synchronizes gradients is a role, ``grad_sync``, owned by exactly one of ddp / zero2 / fsdp /
a DeepSpeed engine; who shards optimizer state is ``optimizer_state_sharding``. compose() rejects
two owners with the reasons written in the conflicts below; nothing here checks combinations.
ddp's contract also declares it the default owner of ``grad_sync`` at world size >= 2
(:class:`~composable_atorch.core.contract.DefaultOwner`): a plan with no owner there gets
parallel_mode + ddp, said in explain() (``strict=True`` raises). The roles, conflict reasons and
sync hooks the data-parallel modules share live in :mod:`.common`.

DDP is torch's composable ``replicate`` (DistributedDataParallel underneath) rather than the
``DistributedDataParallel`` wrapper: it works in place and keeps parameter names, where the
wrapper prefixes every name with ``module.``. Without a process group (a single process that was
not launched by torchrun) there is nothing to synchronize, so ddp leaves the model alone and says
so in the report: a world of 1 is allowed on purpose, so one plan serves both a laptop run and a
launched one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from composable_atorch.core.contract import Conflict, Contract, Cost, DefaultOwner, Implication, MinWorldSize, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError
from composable_atorch.runtime.layout import normalize_groups, plan_layout, refit_note
from composable_atorch.runtime.liveness import collective_timeout, watch
from composable_atorch.runtime.loader import check_global_batch, dataset_size, padding_note, split_over_data
from composable_atorch.runtime.mesh import make_context
from composable_atorch.transforms.parallel.data.common import (
    DDP_VS_FSDP,
    DDP_VS_ZERO2,
    FAIRSCALE,
    IMPLIES_PARALLEL_MODE,
    SHARDED_STATE,
    ZERO_OPTION_DEFAULTS,
    ExpertGradSync,
    GradSyncHook,
    HasBackends,
    options_label,
    sharded_optimizer,
    zero_options,
)
from composable_atorch.transforms.parallel.data.meshes import hybrid_option
from composable_atorch.transforms.parallel.shared.probe import Probe, probe_unused
from composable_atorch.transforms.parallel.shared.sync import (
    GRAD_SYNC,
    OPTIMIZER_STATE_SHARDING,
    DataGradSync,
    broadcast_local,
    parallel_context,
)

# ---------------------------------------------------------------------------------------------
# parallel_mode
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelMode(Transform):
    """Process groups and a device mesh from ATorch's layout; the loader split over the data dimension.

    ``groups`` is ATorch's ``[(name, size), ...]`` (first name varies fastest over the ranks);
    the data size is adjusted to the world size as ATorch describes. Alone, it trains data-parallel
    with ddp (as ATorch's ``["parallel_mode", ...]`` does): some transform must own gradient sync.
    Call ``loader.sampler.set_epoch(epoch)`` each epoch to reshuffle, as with any DistributedSampler.
    """

    name = "parallel_mode"
    contract = Contract(
        stage=Stage.PROCESS_GROUPS,
        roles=("process_groups",),
        implies=(
            Implication(
                "ddp",
                "ranks see different samples, so some transform must synchronize gradients (ATorch's parallel_mode "
                "means DDP)",
                satisfied_by=(GRAD_SYNC,),
            ),
        ),
    )

    groups: tuple = (("data", 1),)
    rank_order: tuple | None = None
    distributed_sampler_cls: type | None = None
    #: ATorch's third element: the groups' sizes are kept and world / product independent instances
    #: (each its own model copy and groups, nothing synchronized between them) fill the world
    multi_instance: bool = False
    #: seconds a collective may wait (None: ``launch --timeout`` or 300 s); see runtime.liveness
    timeout_s: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "groups", normalize_groups(self.groups))
        if not isinstance(self.multi_instance, bool):
            raise ConfigError("parallel_mode.multi_instance", self.multi_instance, "True or False")
        if self.timeout_s is not None:
            object.__setattr__(self, "timeout_s", collective_timeout(self.timeout_s))
        if self.rank_order is not None:
            if isinstance(self.rank_order, str) or not isinstance(self.rank_order, list | tuple):
                raise ConfigError("parallel_mode.rank_order", self.rank_order, "a list of ranks, or None")
            object.__setattr__(self, "rank_order", tuple(self.rank_order))
        cls = self.distributed_sampler_cls
        if cls is not None and not (isinstance(cls, type) and issubclass(cls, torch.utils.data.Sampler)):
            raise ConfigError(
                "parallel_mode.distributed_sampler_cls", cls, "a Sampler class with DistributedSampler's arguments"
            )

    @classmethod
    def from_seed(cls, config=None):
        """ATorch's forms: None, ``(groups, rank_order)``, ``(groups, rank_order, multi_instance)`` or ``groups``."""
        if config is None:
            return cls()
        if isinstance(config, dict):
            return super().from_seed(config)
        if (
            isinstance(config, list | tuple)
            and 2 <= len(config) <= 3
            and isinstance(config[0], list | tuple)
            and (not config[0] or isinstance(config[0][0], list | tuple))
        ):
            multi = config[2] if len(config) == 3 else False
            if not isinstance(multi, bool):
                raise ConfigError("parallel_mode config[2] (multiple parallel instances)", multi, "True or False")
            return cls(groups=config[0], rank_order=config[1], multi_instance=multi)
        return cls(groups=config)

    def describe(self):
        order = "" if self.rank_order is None else f", rank_order={list(self.rank_order)}"
        sampler = "" if self.distributed_sampler_cls is None else f", sampler {self.distributed_sampler_cls.__name__}"
        multi = ", multiple instances" if self.multi_instance else ""
        return f"parallel_mode({' x '.join(f'{n} {s}' for n, s in self.groups)}{order}{sampler}{multi})"

    def layout(self, world_size: int):
        return plan_layout(self.groups, world_size, self.rank_order, self.multi_instance)

    def resolve(self, env):
        layout = self.layout(env.world_size)
        if self.multi_instance:
            n = layout.size("instance")
            return self, (f"{n} independent instances of {self.describe()}: {layout.describe()}" if n > 1 else None)
        if layout.dims == self.groups:
            return self, None
        return replace(self, groups=layout.dims), refit_note(self.groups, layout)

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        layout = self.layout(ctx.env.world_size)
        if state.loader is not None and layout.batch_split > 1:
            check_global_batch(state.loader, layout)  # before the mesh's groups exist
        pc = make_context(layout, ctx.env.device)
        state.parallel = pc
        where = f"device mesh {layout.mesh_dim_names}" if pc.distributed else "no process group (single process)"
        if pc.distributed:
            where += f"; collective timeout {watch(self.timeout_s):g} s, heartbeat names a rank that stops"
        state.note(
            self.name,
            f"{layout.describe()}; {where}; this rank {pc.rank} is data shard {pc.data_rank} of {pc.data_size}"
            + (f" in instance {pc.instance_index} of {pc.instance_num}" if pc.instance_num > 1 else ""),
        )
        if state.loader is not None and (pc.data_size > 1 or pc.distributed):
            state.loader, per_rank = split_over_data(
                state.loader, layout, pc.rank, distributed=pc.distributed, sampler_cls=self.distributed_sampler_cls
            )
            kind = (self.distributed_sampler_cls or torch.utils.data.distributed.DistributedSampler).__name__
            state.note(
                self.name,
                f"loader: {kind}, per-rank batch {per_rank} = global {per_rank * pc.data_size} / {pc.data_size}"
                + ("" if pc.data_size > 1 else " (one global order every rank reads, at any world size)"),
            )
            padding = padding_note(dataset_size(state.loader), pc.data_size, bool(state.loader.drop_last))
            if padding is not None and self.distributed_sampler_cls is None:
                state.note(self.name, f"loader: {kind} {padding}")
        return state


def parallel_mode(
    groups=(("data", 1),), rank_order=None, *, distributed_sampler_cls=None, timeout_s=None
) -> ParallelMode:
    """``parallel_mode([("tensor", 2), ("data", 2)])``; the data size is adjusted to the world size.

    ``timeout_s``: how long a collective may wait for a stopped rank before the job ends naming it.
    """
    return ParallelMode(
        groups=groups, rank_order=rank_order, distributed_sampler_cls=distributed_sampler_cls, timeout_s=timeout_s
    )


# ---------------------------------------------------------------------------------------------
# ddp
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ddp(Transform):
    """Replicate the model on every data-parallel rank and all-reduce gradients (torch's replicate/DDP)."""

    name = "ddp"
    contract = Contract(
        stage=Stage.DATA_PARALLEL,
        owns=(GRAD_SYNC,),
        roles=("data_parallel",),
        implies=(IMPLIES_PARALLEL_MODE,),
        defaults=(
            DefaultOwner(
                GRAD_SYNC,
                MinWorldSize(minimum=2),
                "with more than one process and nothing synchronizing gradients, every rank would train its own model "
                "(ATorch's default: parallel_mode + DDP)",
            ),
        ),
        conflicts=(
            Conflict("fsdp", DDP_VS_FSDP, "drop ddp: fsdp synchronizes gradients itself"),
            Conflict("zero2", DDP_VS_ZERO2, "drop ddp: zero2 synchronizes gradients itself"),
        ),
        # the C++ reducer needs real storage; its buckets hold one more copy of the gradients
        cost=Cost(simulated=False, grad_copies=1.0),
    )

    find_unused_parameters: bool = False
    bucket_cap_mb: float | None = None
    broadcast_buffers: bool = True
    gradient_as_bucket_view: bool = True

    def __post_init__(self):
        if self.bucket_cap_mb is not None and (
            isinstance(self.bucket_cap_mb, bool)
            or not isinstance(self.bucket_cap_mb, int | float)
            or self.bucket_cap_mb <= 0
        ):
            raise ConfigError("ddp.bucket_cap_mb", self.bucket_cap_mb, "a positive number of MiB, or None for DDP's 25")

    @classmethod
    def candidates(cls, search):
        return (cls(),) if search.env.world_size >= 2 else ()

    def describe(self):
        extra = ", find_unused_parameters" if self.find_unused_parameters else ""
        return f"ddp(all-reduce gradients{extra})"

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        from torch.distributed._composable import replicate

        pc = parallel_context(state, self.name)
        if not pc.distributed:
            state.note(
                self.name, "no process group: a single process has no gradients to synchronize, model left as it is"
            )
            return state
        # -- model parallelism: a data dimension of 1 has nothing to synchronize --
        if pc.data_size == 1:
            state.note(
                self.name,
                f"data dimension of 1 ({pc.layout.describe()}): no gradients to synchronize, model left as it is",
            )
            return state
        if any(hasattr(p, "placements") for p in state.model.parameters()):
            # replicate/DDP does not take tensor-parallel DTensor parameters (mixed Tensor/DTensor at forward)
            broadcast_local(state.model, pc.data_group())
            state.hooks.append(DataGradSync(state.model, pc.data_group(), pc.data_size))
            state.note(
                self.name,
                f"tensor-parallel (DTensor) parameters: gradients all-reduced over the data group of {pc.data_size} "
                "before each step (DDP's replicate does not take DTensors)",
            )
            return state
        # -- end model parallelism --
        kwargs = {
            "process_group": pc.data_group(),
            "find_unused_parameters": self.find_unused_parameters,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
        }
        if not self.broadcast_buffers:  # passed only when off: torch warns the keyword is being renamed
            kwargs["broadcast_buffers"] = False
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        if ctx.env.device == "cuda":
            kwargs["device_id"] = torch.cuda.current_device()
        if not self.find_unused_parameters:
            kwargs["find_unused_parameters"] = _probe_unused(state)
        experts = pc.experts
        if experts is not None:  # expert parallelism: experts differ per expert rank, kept out of the replicas
            kwargs["ignored_modules"] = list(experts.modules)
            params = [p for m in experts.modules for p in m.parameters() if p.requires_grad]
            size = experts.replicas
            state.hooks.append(ExpertGradSync(params, experts.replica_mesh, size))
            n = len(experts.modules)
            state.note(
                self.name,
                f"{n} experts module(s) kept out of replicate: their gradients averaged over the {size} "
                "rank(s) holding the same experts before each step",
            )
        replicate(state.model, **kwargs)
        state.hooks.append(GradSyncHook(state.model))
        state.note(
            self.name,
            f"replicate (DDP) over the data group of {pc.data_size}; parameter names kept; sync skipped inside "
            "accumulation windows",
        )
        if pc.zero_size > 1:
            state.note(self.name, _ZERO_UNDER_DDP.format(zero=pc.zero_size, n=pc.data_size))
        return state


#: explain()'s line for ddp with a zero dimension: plain data parallelism over data x zero
_ZERO_UNDER_DDP = (
    "the 'zero' dimension ({zero}) shards nothing under ddp: every rank holds the whole model and gradients are "
    "all-reduced over data x zero = {n} ranks (fsdp / zero2 shard inside it, zero1 shards the optimizer state in it)"
)

#: parameters beyond which ddp does not probe (the probe holds a zero copy of the model in CPU memory)
PROBE_LIMIT = 50_000_000


def _probe_unused(state: TrainState) -> bool:
    """True when a probe forward/backward (zero-weight replica, example input) leaves parameters
    without a gradient: torch's reducer would otherwise stop at the second step with "Expected to
    have finished reduction". ddp then finds unused parameters itself, and says so."""
    numel = sum(p.numel() for p in state.model.parameters())
    probe = (
        probe_unused(state.model)
        if numel <= PROBE_LIMIT
        else Probe(
            None,
            f"{numel:,} parameters, over the probe's limit of {PROBE_LIMIT:,} (it holds a zero copy of the model "
            "in CPU memory)",
        )
    )
    if probe.unused is None:
        state.note(
            "ddp",
            f"not probed for unused parameters: {probe.reason}; find_unused_parameters stays off (a parameter "
            "without a gradient would stop torch's reducer at the second step: ddp(find_unused_parameters=True) then)",
        )
        return False
    unused = probe.unused
    if not unused:
        return False
    shown = ", ".join(unused[:3]) + (" ..." if len(unused) > 3 else "")
    state.note(
        "ddp",
        f"{len(unused)} parameter(s) get no gradient in a probe step ({shown}): find_unused_parameters turned on "
        "(ddp(find_unused_parameters=True) says so explicitly; it costs a graph walk per step)",
    )
    return True


def ddp(
    find_unused_parameters: bool = False, *, bucket_cap_mb=None, broadcast_buffers=True, gradient_as_bucket_view=True
) -> Ddp:
    """torch's DDP over the data group. ``gradient_as_bucket_view`` is on by default (torch's is off):
    the gradients are views of the all-reduce buckets, so no copy in or out of them each step (4-8%
    of a bf16 step of a small GPT on the CPU here) and one gradient-sized buffer less."""
    return Ddp(find_unused_parameters, bucket_cap_mb, broadcast_buffers, gradient_as_bucket_view)


# ---------------------------------------------------------------------------------------------
# zero1
# ---------------------------------------------------------------------------------------------

ZERO1_BACKENDS = ("torch", "fairscale", "deepspeed")


@dataclass(frozen=True)
class Zero1(HasBackends, Transform):
    """Shard the optimizer state over the data-parallel ranks; gradients are all-reduced (by ddp).

    ``backend``: ``"torch"`` (ZeroRedundancyOptimizer, default), ``"fairscale"`` (OSS) or
    ``"deepspeed"`` (ZeRO stage 1 in a DeepSpeed engine, which then owns gradient sync too).
    """

    name = "zero1"
    contract = Contract(
        stage=Stage.OPTIMIZER,
        owns=(OPTIMIZER_STATE_SHARDING,),
        roles=("zero",),
        requires=(FAIRSCALE,),
        implies=(IMPLIES_PARALLEL_MODE,),
        conflicts=(
            Conflict("fsdp", f"fsdp {SHARDED_STATE}", "drop zero1"),
            Conflict("zero2", f"zero2 {SHARDED_STATE}", "drop zero1"),
        ),
    )

    backend: str = "torch"
    #: ATorch's zero keys (cpu_offload, static_loss_scale, bucket sizes...; see common.ZERO_OPTION_DEFAULTS)
    options: tuple = ()

    def __post_init__(self):
        if self.backend not in ZERO1_BACKENDS:
            raise ConfigError("zero1.backend", self.backend, ", ".join(map(repr, ZERO1_BACKENDS)))
        object.__setattr__(self, "options", zero_options(self.options, "zero1", self.backend))

    @classmethod
    def from_seed(cls, config=None):
        """Seed: None, or ``{"use_ds_zero": True}`` for DeepSpeed; ``{"backend": ...}`` also works."""
        if config is None:
            return cls()
        if isinstance(config, dict):
            config = dict(config)
            if config.pop("use_ds_zero", False):
                config["backend"] = "deepspeed"
            options = {k: config.pop(k) for k in list(config) if k in ZERO_OPTION_DEFAULTS}
            return super().from_seed({**config, "options": tuple(options.items())} if options else config)
        return cls(backend=config)

    @classmethod
    def candidates(cls, search):
        """Sharded over the data ranks; on several nodes also the ``zero x data`` layout (sharded per node)."""
        return ((cls(),) + hybrid_option(search)) if search.env.world_size >= 2 else ()

    def describe(self):
        impl = {"torch": "ZeroRedundancyOptimizer", "fairscale": "fairscale OSS"}[self.backend]
        return f"zero1(optimizer state sharded, {impl}{options_label(self.options)})"

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        pc = parallel_context(state, self.name)
        if state.optim is None or not pc.distributed:
            state.note(
                self.name, "nothing to shard: " + ("no optimizer" if state.optim is None else "no process group")
            )
            return state
        # with a zero dimension the state is sharded inside each zero group (ATorch's ZeRO subgroups); the
        # groups of the data dimension hold equal copies (their gradients are all-reduced over data x zero)
        size = pc.zero_size if pc.zero_size > 1 else pc.data_size
        state.optim = sharded_optimizer(state.optim, self.backend, pc.zero_group())
        inner = type(state.optim.optim).__name__
        state.note(
            self.name,
            f"{type(state.optim).__name__}({inner}): each of {size} ranks keeps 1/{size} of the optimizer state"
            + (
                f" (sharded inside the zero group of {size}, replicated over data {pc.layout.size('data')})"
                if pc.zero_size > 1
                else ""
            ),
        )
        return state


def zero1(backend: str = "torch", **options) -> Zero1:
    """``zero1(backend="deepspeed", cpu_offload=True)``: options are ATorch's zero keys."""
    return Zero1(backend=backend, options=tuple(options.items()))
