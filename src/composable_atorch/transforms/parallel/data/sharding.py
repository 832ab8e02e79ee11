"""Sharded data parallelism: ``fsdp`` (ZeRO-3) and ``zero2`` on torch's FSDP2 ``fully_shard``.

FSDP2 works in place and keeps parameter names (parameters become DTensor shards), so the plan
rebuilds the optimizer over the shards by name. ``fully_shard`` is applied to each wrapped block,
children before parents, then to the root. Before sharding, parameters and buffers are broadcast
from the first data-parallel rank (what DDP does at start and FSDP1 calls ``sync_module_states``),
so a model initialised differently per rank still trains as one.

``zero2`` is the same engine with ``reshard_after_forward=False`` (ATorch's default,
SHARD_GRAD_OP), or fairscale's OSS + ShardedDataParallel with ``backend="fairscale"``.

Hybrid sharding (HSDP): with a ``zero`` dimension > 1 in parallel_mode, both shard over the zero
groups and replicate over ``data`` on torch's 2-D ``(replicate, shard)`` mesh (:func:`shard_mesh`);
ATorch's ``sharding_strategy=HYBRID_SHARD`` without one takes the groups from the nodes. A 0-dim
parameter (CLIP's ``logit_scale``), which fully_shard cannot shard, is kept whole on every rank and
its gradient averaged over the data ranks before the step, like an ignored module's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from composable_atorch.core.contract import Conflict, Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError
from composable_atorch.runtime.optim import NAME_PREFIX_ATTR
from composable_atorch.transforms._util import matches
from composable_atorch.transforms.parallel.data.common import (
    DDP_VS_FSDP,
    DDP_VS_ZERO2,
    FAIRSCALE,
    FSDP_VS_ZERO2,
    IMPLIES_PARALLEL_MODE,
    SHARDED_STATE,
    ZERO_DIM_FAIRSCALE,
    ZERO_OPTION_DEFAULTS,
    ZERO_ORDER_CONFLICT,
    GradSyncHook,
    HasBackends,
    IgnoredGradSyncHook,
    KeepGradBuffersHook,
    give_clip_grad_norm,
    options_label,
    sharded_optimizer,
    zero_options,
)
from composable_atorch.transforms.parallel.data.meshes import hybrid_option, shard_experts, shard_mesh
from composable_atorch.transforms.parallel.data.wrap import (
    FSDP1_OPTIONS,
    FSDP1_REFUSED,
    block_targets,
    from_auto_wrap_policy,
    from_sharding_strategy,
    target_name,
    wrap_targets,
)
from composable_atorch.transforms.parallel.shared.sync import GRAD_SYNC, OPTIMIZER_STATE_SHARDING, parallel_context
from composable_atorch.transforms.policy import PRECISION_READS, PrecisionPolicy

#: fully_shard keywords the transform sets itself; the rest may pass through ``fsdp_kwargs``.
_OWN_KWARGS = {"module", "mesh", "reshard_after_forward", "mp_policy", "offload_policy", "ignored_params"}


def broadcast_module_states(model: nn.Module, group, skip=()) -> None:
    """Make every rank start from data-rank 0's parameters and buffers (except those in ``skip``)."""
    skipped = {id(t) for t in skip}
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) in skipped:
                continue
            # model parallelism: a tensor-parallel DTensor broadcasts its local shard
            local = t._local_tensor if hasattr(t, "_local_tensor") else t.data
            dist.broadcast(local, group=group, group_src=0)


def shard(spec: Fsdp, who: str, state: TrainState, ctx: ApplyContext, *, sync_at_start: bool = True) -> TrainState:
    """Apply FSDP2 as the fsdp config ``spec`` says; the shared body of fsdp and zero2(backend="fsdp").

    zero2 passes ``Fsdp(wrap=..., reshard_after_forward=False)``: it is this engine keeping the
    parameters whole after forward, so the sharding fields are fsdp's own, defined once.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    pc = parallel_context(state, who)
    if not pc.distributed:
        state.note(who, "no process group: a single process has nothing to shard, model left as it is")
        return state
    model, group = state.model, pc.data_group()
    mesh, where = shard_mesh(pc, spec, ctx, state, who)
    ignored_modules = {
        m for q, m in model.named_modules() if spec.ignored and m is not model and matches(m, q, spec.ignored)
    }
    ignored_params = {p for m in ignored_modules for p in m.parameters()}
    ignored_ids = {id(p) for p in ignored_params}
    # fully_shard cannot shard a 0-dim parameter (CLIP's logit_scale): kept whole like an ignored one
    scalars = {n: p for n, p in model.named_parameters() if p.dim() == 0 and id(p) not in ignored_ids}
    kept_whole = ignored_params | set(scalars.values())
    kwargs = dict(spec.fsdp_kwargs)
    kwargs["reshard_after_forward"] = spec.reshard_after_forward
    kwargs["ignored_params"] = kept_whole or None
    policy = PrecisionPolicy.of(ctx)
    if policy.autocast:  # amp without half: parameters stay float32 and are all-gathered in amp's dtype
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=policy.compute_dtype, reduce_dtype=torch.float32)
        state.note(
            who, f"mixed precision from amp: parameters all-gathered in {policy.name}, gradients reduced in float32"
        )
    kwargs["offload_policy"] = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if spec.cpu_offload else OffloadPolicy()
    )
    experts = [] if pc.experts is None else list(pc.experts.modules)
    if sync_at_start:  # experts differ per expert rank: expert_parallel started them from one model already
        broadcast_module_states(model, group, skip=[p for m in experts for p in m.parameters()])
    else:
        state.note(
            who,
            "sync_models_at_startup=False: rank 0's weights are not broadcast (every rank must start from the same "
            "weights)",
        )
    targets = wrap_targets(
        model, spec.wrap, spec.min_params, ignored_modules, spec.wrap_trainable_outmost, spec.wrap_policy
    )
    shard_experts(experts, pc, kwargs, state, who)
    for module in targets:
        fully_shard(module, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    give_clip_grad_norm(model)
    state.hooks.append(GradSyncHook(model))
    kinds = sorted({type(m).__name__ for m in targets})
    state.note(
        who,
        f"fully_shard on {len(targets)} module(s) ({', '.join(kinds) or 'none'}) then the root, "
        f"{where}; reshard_after_forward={spec.reshard_after_forward}"
        f"{', parameters offloaded to CPU' if spec.cpu_offload else ''}",
    )
    trainable = [p for p in kept_whole if p.requires_grad]
    if trainable:
        state.hooks.append(IgnoredGradSyncHook(trainable, group, pc.data_size))
    if ignored_params:
        state.note(
            who,
            f"{len(ignored_params)} parameter(s) of ignored modules kept whole; their gradients averaged before the "
            "step",
        )
    if scalars:
        shown = ", ".join(list(scalars)[:3]) + (" ..." if len(scalars) > 3 else "")
        state.note(
            who,
            f"{len(scalars)} 0-dim parameter(s) kept whole ({shown}): fully_shard cannot shard a scalar; replicated "
            f"on every rank, gradients averaged over the {pc.data_size} data ranks before each step",
        )
    return state


def _fsdp_kwargs(kwargs) -> tuple:
    from torch.distributed.fsdp import fully_shard

    items = dict(kwargs or ())
    allowed = set(inspect.signature(fully_shard).parameters) - _OWN_KWARGS
    bad = sorted(set(items) - allowed)
    if bad:
        raise ConfigError(
            f"fsdp keyword {bad[0]!r}",
            items[bad[0]],
            f"fully_shard keywords {sorted(allowed)} (the others are fsdp's own fields)",
        )
    return tuple(sorted(items.items()))


# ---------------------------------------------------------------------------------------------
# fsdp
# ---------------------------------------------------------------------------------------------

FSDP_BACKENDS = ("torch", "deepspeed")


@dataclass(frozen=True)
class Fsdp(HasBackends, Transform):
    """Fully sharded data parallelism (ZeRO-3): parameters, gradients and optimizer state sharded.

    ``wrap`` (classes or names) or ``min_params`` (size-based) choose the blocks sharded as their
    own groups; ``ignored`` modules stay whole. With ``amp`` in the plan the parameters are
    all-gathered in amp's dtype. ``backend="deepspeed"`` runs DeepSpeed ZeRO-3 instead.
    """

    name = "fsdp"
    contract = Contract(
        stage=Stage.DATA_PARALLEL,
        owns=(GRAD_SYNC, OPTIMIZER_STATE_SHARDING),
        roles=("sharding", "data_parallel"),
        reads=PRECISION_READS,
        implies=(IMPLIES_PARALLEL_MODE,),
        conflicts=(
            Conflict("ddp", DDP_VS_FSDP, "drop ddp: fsdp synchronizes gradients itself"),
            Conflict("zero2", FSDP_VS_ZERO2, "keep one of fsdp (ZeRO-3) and zero2"),
            Conflict("zero1", f"fsdp {SHARDED_STATE}", "drop zero1"),
            ZERO_ORDER_CONFLICT,
        ),
    )

    wrap: tuple = ()
    min_params: int = 0
    ignored: tuple = ()
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    wrap_trainable_outmost: bool = False
    backend: str = "torch"
    fsdp_kwargs: tuple = ()
    #: ATorch's FSDP1 options with no FSDP2 meaning, kept so explain() shows they were read
    fsdp1_options: tuple = ()
    #: an FSDP1-style auto_wrap_policy(module, recurse, nonwrapped_numel) choosing the modules to shard
    wrap_policy: Any = None
    #: ATorch's sharding_strategy=HYBRID_SHARD: shard inside a node, replicate across nodes (without a
    #: 'zero' dimension the groups are taken from the world; with one, the zero dimension is the shard group)
    hybrid: bool = False

    def __post_init__(self):
        object.__setattr__(self, "wrap", block_targets(self.wrap, "fsdp.wrap"))
        object.__setattr__(self, "ignored", block_targets(self.ignored, "fsdp.ignored"))
        if isinstance(self.min_params, bool) or not isinstance(self.min_params, int) or self.min_params < 0:
            raise ConfigError("fsdp.min_params", self.min_params, "an integer >= 0 (0: no size-based wrapping)")
        if self.wrap_policy is not None and (not callable(self.wrap_policy) or self.wrap or self.min_params):
            raise ConfigError(
                "fsdp.wrap_policy",
                self.wrap_policy,
                "a callable policy(module, recurse, nonwrapped_numel), with no wrap or min_params beside it",
            )
        if self.wrap and self.min_params:
            raise ConfigError(
                "fsdp.min_params", self.min_params, "0 when wrap is given (choose blocks by class or by size, not both)"
            )
        if self.backend not in FSDP_BACKENDS:
            raise ConfigError("fsdp.backend", self.backend, ", ".join(map(repr, FSDP_BACKENDS)))
        object.__setattr__(self, "fsdp_kwargs", _fsdp_kwargs(self.fsdp_kwargs))
        object.__setattr__(self, "fsdp1_options", tuple(sorted(tuple(kv) for kv in self.fsdp1_options)))

    @classmethod
    def from_seed(cls, config=None):
        """ATorch's dict: atorch_wrap_cls / atorch_size_based_min_num_params / atorch_ignored_cls, FSDP options."""
        if config is None:
            return cls()
        if not isinstance(config, dict):
            raise ConfigError("fsdp config", config, "a dict such as {'atorch_wrap_cls': (Block,)}")
        cfg = dict(config)
        for key, why in FSDP1_REFUSED.items():
            if key in cfg and not (key == "device_id" and cfg[key] in (None, "cpu")):
                raise ConfigError(
                    f"fsdp config key {key!r}", cfg[key], f"not given: it has no FSDP2 meaning here ({why})"
                )
            cfg.pop(key, None)
        if "auto_wrap_policy" in cfg:
            if "atorch_wrap_cls" in cfg or "atorch_size_based_min_num_params" in cfg:
                raise ConfigError(
                    "fsdp auto_wrap_policy",
                    cfg["auto_wrap_policy"],
                    "absent when atorch_wrap_cls or atorch_size_based_min_num_params is given",
                )
            mapped = from_auto_wrap_policy(cfg.pop("auto_wrap_policy"))
            key = {"wrap": "atorch_wrap_cls", "min_params": "atorch_size_based_min_num_params"}
            cfg.update({key.get(k, k): v for k, v in mapped.items()})
        if "sharding_strategy" in cfg:
            cfg["reshard_after_forward"], hybrid = from_sharding_strategy(cfg.pop("sharding_strategy"))
            if hybrid:
                cfg["hybrid"] = True
        if isinstance(cfg.get("wrap_trainable_outmost"), str):
            if cfg["wrap_trainable_outmost"] == "NO_SHARD":
                raise ConfigError(
                    "fsdp wrap_trainable_outmost",
                    "NO_SHARD",
                    "True: FSDP2 shards the root group (NO_SHARD is deprecated)",
                )
            cfg["wrap_trainable_outmost"] = True
        renames = {
            "atorch_wrap_cls": "wrap",
            "atorch_size_based_min_num_params": "min_params",
            "atorch_ignored_cls": "ignored",
            "fsdp_wrap_params_outmost": "wrap_trainable_outmost",
        }
        fields = {renames.get(k, k): v for k, v in cfg.items() if k not in FSDP1_OPTIONS}
        if "cpu_offload" in fields and not isinstance(fields["cpu_offload"], bool):
            fields["cpu_offload"] = bool(getattr(fields["cpu_offload"], "offload_params", fields["cpu_offload"]))
        if cfg.get("use_ds_zero"):
            fields.pop("use_ds_zero")
            fields["backend"] = "deepspeed"
        known = {
            "wrap",
            "min_params",
            "ignored",
            "reshard_after_forward",
            "cpu_offload",
            "wrap_trainable_outmost",
            "backend",
            "wrap_policy",
            "hybrid",
        }
        extra = {k: fields.pop(k) for k in list(fields) if k not in known}
        return cls(
            **fields,
            fsdp_kwargs=tuple(extra.items()),
            fsdp1_options=tuple((k, cfg[k]) for k in FSDP1_OPTIONS if k in cfg),
        )

    @classmethod
    def candidates(cls, search):
        """One per block class; with several nodes also hybrid (shard inside a node, replicate across),
        and the ``zero x data`` layout that names those groups (:func:`~.meshes.hybrid_option`)."""
        if search.env.world_size < 2:
            return ()
        flat = tuple(cls(wrap=(b,)) for b in search.block_classes)
        if search.env.nodes > 1 and search.env.processes_per_node > 1:
            return flat + tuple(cls(wrap=(b,), hybrid=True) for b in search.block_classes) + hybrid_option(search)
        return flat

    def describe(self):
        policy = getattr(self.wrap_policy, "func", self.wrap_policy)  # a partial names its function
        how = (
            f"wrap where the policy {getattr(policy, '__name__', type(policy).__name__)} says so"
            if self.wrap_policy is not None
            else f"wrap {', '.join(map(target_name, self.wrap))}"
            if self.wrap
            else (f"wrap blocks of >= {self.min_params} params" if self.min_params else "root only")
        )
        parts = [how]
        if self.ignored:
            parts.append(f"ignore {', '.join(map(target_name, self.ignored))}")
        if not self.reshard_after_forward:
            parts.append("keep parameters after forward")
        if self.cpu_offload:
            parts.append("CPU offload")
        if self.wrap_trainable_outmost:
            parts.append("trainable parameters in the root group")
        if self.hybrid:
            parts.append("HYBRID_SHARD: shard inside a node or zero group, replicate across")
        if self.fsdp1_options:
            parts.append(f"FSDP1-only options read and moot in FSDP2: {', '.join(k for k, _ in self.fsdp1_options)}")
        return f"fsdp({'; '.join(parts)})"

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        return shard(self, self.name, state, ctx)


def fsdp(
    wrap=(),
    *,
    min_params=0,
    ignored=(),
    reshard_after_forward=True,
    cpu_offload=False,
    wrap_trainable_outmost=False,
    backend="torch",
    hybrid=False,
    **fsdp_kwargs,
) -> Fsdp:
    """``fsdp(wrap=(Block,))``; extra keywords go to torch's ``fully_shard``.

    With ``('zero', n)`` in parallel_mode it shards over the zero groups and replicates over data
    (hybrid sharding); ``hybrid=True`` (ATorch's HYBRID_SHARD) does so without one, per node."""
    return Fsdp(
        wrap,
        min_params,
        ignored,
        reshard_after_forward,
        cpu_offload,
        wrap_trainable_outmost,
        backend,
        tuple(fsdp_kwargs.items()),
        hybrid=hybrid,
    )


# ---------------------------------------------------------------------------------------------
# zero2
# ---------------------------------------------------------------------------------------------

ZERO2_BACKENDS = ("fsdp", "fairscale", "deepspeed")


@dataclass(frozen=True)
class Zero2(HasBackends, Transform):
    """ZeRO-2: gradients and optimizer state sharded, parameters whole during compute.

    ``backend``: ``"fsdp"`` (FSDP2 with ``reshard_after_forward=False``, default), ``"fairscale"``
    (OSS + ShardedDataParallel, whose wrapper prefixes names with ``module.``; the plan maps them
    back) or ``"deepspeed"`` (ZeRO stage 2 in a DeepSpeed engine).
    """

    name = "zero2"
    contract = Contract(
        stage=Stage.DATA_PARALLEL,
        owns=(GRAD_SYNC, OPTIMIZER_STATE_SHARDING),
        roles=("sharding", "data_parallel", "zero"),
        reads=PRECISION_READS,
        requires=(FAIRSCALE,),
        implies=(IMPLIES_PARALLEL_MODE,),
        conflicts=(
            Conflict("ddp", DDP_VS_ZERO2, "drop ddp: zero2 synchronizes gradients itself"),
            Conflict("fsdp", FSDP_VS_ZERO2, "keep one of fsdp (ZeRO-3) and zero2"),
            Conflict("zero1", f"zero2 {SHARDED_STATE}", "drop zero1"),
            ZERO_ORDER_CONFLICT,
            ZERO_DIM_FAIRSCALE,
        ),
    )

    backend: str = "fsdp"
    wrap: tuple = ()
    #: ATorch's zero keys (cpu_offload, static_loss_scale, sync_models_at_startup...; see common.ZERO_OPTION_DEFAULTS)
    options: tuple = ()

    def __post_init__(self):
        if self.backend not in ZERO2_BACKENDS:
            raise ConfigError("zero2.backend", self.backend, ", ".join(map(repr, ZERO2_BACKENDS)))
        object.__setattr__(self, "options", zero_options(self.options, "zero2", self.backend))
        object.__setattr__(self, "wrap", block_targets(self.wrap, "zero2.wrap"))
        if self.wrap and self.backend != "fsdp":
            raise ConfigError("zero2.wrap", self.wrap, "() unless backend='fsdp' (only FSDP wraps blocks)")

    @classmethod
    def from_seed(cls, config=None):
        """Seed: None (FSDP), ``{"not_use_fsdp": True}`` (fairscale), ``{"use_ds_zero": True}`` (DeepSpeed)."""
        if config is None:
            return cls()
        if not isinstance(config, dict):
            return cls(backend=config)
        cfg = dict(config)
        backend = (
            "deepspeed"
            if cfg.pop("use_ds_zero", False)
            else ("fairscale" if cfg.pop("not_use_fsdp", False) else cfg.pop("backend", "fsdp"))
        )
        wrap = cfg.pop("atorch_wrap_cls", cfg.pop("wrap", ()))
        options = tuple((k, cfg.pop(k)) for k in list(cfg) if k in ZERO_OPTION_DEFAULTS)
        unknown = sorted(set(cfg) - set(FSDP1_OPTIONS))
        if unknown:
            raise ConfigError(
                f"zero2 config key {unknown[0]!r}",
                cfg[unknown[0]],
                f"use_ds_zero, not_use_fsdp, atorch_wrap_cls, {', '.join(ZERO_OPTION_DEFAULTS)}, or FSDP1 options",
            )
        return cls(backend=backend, wrap=wrap, options=options)

    @classmethod
    def candidates(cls, search):
        """Sharded over the data ranks; on several nodes also the ``zero x data`` layout (hybrid sharding)."""
        return ((cls(),) + hybrid_option(search)) if search.env.world_size >= 2 else ()

    def describe(self):
        if self.backend == "fairscale":
            return f"zero2(fairscale OSS + ShardedDataParallel{options_label(self.options)})"
        wrap = f"; wrap {', '.join(map(target_name, self.wrap))}" if self.wrap else ""
        return f"zero2(FSDP2, reshard_after_forward=False{wrap}{options_label(self.options)})"

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        opts = dict(self.options)
        if self.backend == "fsdp":
            spec = Fsdp(wrap=self.wrap, reshard_after_forward=False, cpu_offload=bool(opts.get("cpu_offload", False)))
            return shard(spec, self.name, state, ctx, sync_at_start=opts.get("sync_models_at_startup", True))
        return self._fairscale(state)

    def _fairscale(self, state: TrainState) -> TrainState:
        from fairscale.nn.data_parallel import ShardedDataParallel

        pc = parallel_context(state, self.name)
        if state.optim is None or not pc.distributed:
            state.note(
                self.name, "nothing to shard: " + ("no optimizer" if state.optim is None else "no process group")
            )
            return state
        group = pc.data_group()
        state.optim = sharded_optimizer(state.optim, "fairscale", group)
        sync = dict(self.options).get("sync_models_at_startup", True)
        wrapped = ShardedDataParallel(state.model, state.optim, process_group=group, sync_models_at_startup=sync)
        setattr(wrapped, NAME_PREFIX_ATTR, "module.")
        state.model = wrapped
        pc.grad_shard_group = group  # amp's scaler and clip_grad reduce their checks over it
        state.hooks.append(GradSyncHook(wrapped, no_sync=wrapped.no_sync))
        state.hooks.append(KeepGradBuffersHook())
        state.note(
            self.name,
            f"fairscale OSS + ShardedDataParallel over {pc.data_size} ranks; names prefixed 'module.' by the wrapper, "
            "mapped back for the optimizer",
        )
        return state


def zero2(backend: str = "fsdp", *, wrap=(), **options) -> Zero2:
    """``zero2()`` (FSDP2), ``zero2("deepspeed", cpu_offload=True)``: options are ATorch's zero keys."""
    return Zero2(backend=backend, wrap=wrap, options=tuple(options.items()))
