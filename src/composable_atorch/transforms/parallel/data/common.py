"""What the data-parallel transforms share: conflict reasons, sync hooks, backend variants.

(What every parallel axis shares — the context, the gradient-sync roles, averaging over a group,
the broadcast of local tensors, the probe — is in :mod:`composable_atorch.transforms.parallel.shared`.)

``data_parallel`` (parallel_mode, ddp, zero1), ``sharding`` (fsdp, zero2) and ``deepspeed`` (their
DeepSpeed engine variants) all import this module and none imports another's private helpers,
so there is no import cycle among them.

Backend variants register themselves: ``class DeepSpeedZero1(Zero1, backend="deepspeed")`` makes
``zero1(backend="deepspeed")`` resolve (at compose time) to that class, through the generic
:meth:`HasBackends.resolve`. A variant living in a module nobody imported yet is loaded by its
module name from :data:`BACKEND_MODULES` on first use (a name, not an import, so the base
module never depends on the variant's).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from composable_atorch.core.contract import Conflict, Implication, Package, When
from composable_atorch.errors import ConfigError
from composable_atorch.runtime.optim import OptimizerHook
from composable_atorch.transforms.parallel.shared.grads import clip_grads_

# -- the conflicts between gradient-sync owners, written once ----------------------------------
DDP_VS_FSDP = "fsdp reduce-scatters gradients itself; DDP would all-reduce them a second time"
DDP_VS_ZERO2 = "zero2 reduce-scatters gradients itself; DDP would all-reduce them a second time"
FSDP_VS_ZERO2 = "zero2 is sharding with reshard_after_forward=False; both would wrap and shard the same parameters"
SHARDED_STATE = "already shards the optimizer state"


def _has_zero_dim(_mine, pm) -> bool:
    return any(n == "zero" and s > 1 for n, s in pm.groups)


def _zero_after_data(_mine, pm) -> bool:
    names = [n for n, _ in pm.groups]
    return _has_zero_dim(_mine, pm) and "data" in names and names.index("zero") > names.index("data")


#: Hybrid sharding (HSDP) is torch's fully_shard on the 2-D (replicate, shard) = (data, zero) mesh; the mesh's
#: dimensions are ATorch's list reversed, so the zero dimension must come first in ATorch's list.
ZERO_ORDER_CONFLICT = Conflict(
    "parallel_mode",
    "hybrid sharding shards over 'zero' and replicates over 'data' on torch's 2-D (replicate, shard) mesh, which "
    "needs 'zero' to vary faster than 'data' over the ranks",
    "list ('zero', n) before ('data', m) in parallel_mode, e.g. [('zero', 8), ('data', 4)] (zero groups are then "
    "neighbouring ranks: one node each when n is the processes per node)",
    when=_zero_after_data,
)
ZERO_DIM_FAIRSCALE = Conflict(
    "parallel_mode",
    "fairscale's ShardedDataParallel shards over one group and has no replicas: it cannot shard over 'zero' and "
    "all-reduce over 'data'",
    "use zero2() (FSDP2 backend: hybrid sharding over the zero dimension), or ('data', n) only",
    when=lambda mine, pm: getattr(mine, "backend", None) == "fairscale" and _has_zero_dim(mine, pm),
)
ZERO_DIM_DEEPSPEED = Conflict(
    "parallel_mode",
    "DeepSpeed's engine partitions over its own data-parallel group; hybrid sharding over the 'zero' dimension is "
    "built on torch's FSDP2",
    "use the torch backend (fsdp(), zero2(), zero1()) for the zero dimension, or ('data', n) only",
    when=_has_zero_dim,
)
IMPLIES_PARALLEL_MODE = Implication(
    "parallel_mode",
    "data parallelism needs the data-parallel process group and the distributed sampler parallel_mode makes",
)


class GradSyncHook(OptimizerHook):
    """Skip the gradient all-reduce / reduce-scatter on micro-batches that do not end a step.

    DDP decides at forward time whether the coming backward synchronizes, so a forward pre-hook
    reads the plan optimizer's ``is_boundary``; FSDP2 decides in its post-backward, which the
    backward context covers too. ``model`` is anything with ``set_requires_gradient_sync`` (a
    replicated or fully-sharded module).
    """

    def __init__(self, model: torch.nn.Module, no_sync=None):
        self.model = model
        self._no_sync = no_sync  # a context-manager factory for engines that decide in backward
        self._optimizer = None
        if no_sync is None:
            model.register_forward_pre_hook(self._before_forward, prepend=True)

    def attach(self, optimizer):
        self._optimizer = optimizer

    def _before_forward(self, module, args):
        if self._optimizer is not None and torch.is_grad_enabled():
            module.set_requires_gradient_sync(self._optimizer.is_boundary)

    def backward_context(self, is_boundary: bool):
        if self._no_sync is not None:
            return contextlib.nullcontext() if is_boundary else self._no_sync()
        if self._optimizer is not None:
            self.model.set_requires_gradient_sync(is_boundary)
        return contextlib.nullcontext()


class IgnoredGradSyncHook(OptimizerHook):
    """Average the gradients of parameters FSDP was told to ignore (it neither shards nor reduces them)."""

    def __init__(self, params: list[torch.nn.Parameter], group, size: int):
        self.params, self.group, self.size = params, group, size

    def before_step(self, optimizer):
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad.div_(self.size)


class ExpertGradSync(OptimizerHook):
    """Expert parameters' gradients averaged over the ranks holding the same experts (each is already
    the mean over its expert group's ranks: expert_parallel's dispatch scales it)."""

    def __init__(self, params: list[torch.nn.Parameter], mesh, divisor: int):
        self.params, self.mesh, self.divisor = params, mesh, divisor

    def before_step(self, optimizer):
        group = None if self.mesh is None or self.mesh.size() == 1 else self.mesh.get_group()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if group is not None:
                dist.all_reduce(p.grad, group=group)
            p.grad.div_(self.divisor)


class KeepGradBuffersHook(OptimizerHook):
    """Zero gradients in place instead of setting them to None.

    fairscale's ShardedDataParallel loses reductions when gradients are None at the next backward
    (measured: 6e-3 off DDP after 5 AdamW steps; bitwise equal when zeroed in place).
    """

    def zero_grad(self, optimizer, set_to_none):
        optimizer.zero_grad(set_to_none=False)
        return True


def _is_fairscale(t) -> bool:
    """backend='fairscale'"""
    return getattr(t, "backend", None) == "fairscale"


def sharded_optimizer(optim: torch.optim.Optimizer, backend: str, group):
    """torch's ZeroRedundancyOptimizer or fairscale's OSS over the same param groups and hyperparameters."""
    if any(len(s) for s in optim.state.values()):
        raise ConfigError(
            "optimizer state", "already stepped", "an optimizer that has not stepped yet (apply the plan first)"
        )
    groups = [dict(g) for g in optim.param_groups]
    # only the defaults the constructor takes (AdamW's hold 'decoupled_weight_decay'); each group
    # carries all of its hyperparameters anyway
    accepted = inspect.signature(type(optim).__init__).parameters
    defaults = {k: v for k, v in optim.defaults.items() if k in accepted}
    if backend == "fairscale":
        from fairscale.optim import OSS

        return OSS(groups, optim=type(optim), group=group, **defaults)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optim), process_group=group, **defaults)


FAIRSCALE = When(predicate=_is_fairscale, inner=Package(name="fairscale", extra="fairscale"))


# ---------------------------------------------------------------------------------------------
# backend variants
# ---------------------------------------------------------------------------------------------

#: (transform name, backend) -> the variant class registered for it.
_VARIANTS: dict[tuple[str, str], type] = {}
#: backend -> the module whose import registers its variants (loaded by name on first use).
BACKEND_MODULES = {"deepspeed": "composable_atorch.transforms.parallel.data.deepspeed"}


class HasBackends:
    """Mixin for transforms with a ``backend`` field whose variants are subclasses.

    ``class V(Base, backend="x")`` registers ``V`` as ``Base`` with ``backend="x"``; V sets
    ``resolve_note`` (shown in explain()). The generic :meth:`resolve` swaps a transform for its
    variant; a backend with no variant class is handled by the base class itself.
    """

    resolve_note: ClassVar[str | None] = None
    variant_backend: ClassVar[str | None] = None

    def __init_subclass__(cls, backend: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if backend is not None:
            key = (cls.name, backend)
            if key in _VARIANTS and _VARIANTS[key].__qualname__ != cls.__qualname__:
                raise ConfigError(
                    f"{cls.name} backend variant",
                    backend,
                    f"one class per backend (taken by {_VARIANTS[key].__qualname__})",
                )
            _VARIANTS[key] = cls
            cls.variant_backend = backend

    def resolve(self, env):
        variant = backend_variant(self.name, self.backend)
        if variant is None or type(self) is variant:
            return self, None
        return variant(**self.config()), variant.resolve_note


def backend_variant(name: str, backend: str) -> type | None:
    """The registered variant class of transform ``name`` for ``backend``, or None."""
    if (name, backend) not in _VARIANTS and backend in BACKEND_MODULES:
        importlib.import_module(BACKEND_MODULES[backend])
    return _VARIANTS.get((name, backend))


# ---------------------------------------------------------------------------------------------
# ATorch's zero1 / zero2 config keys
# ---------------------------------------------------------------------------------------------

#: ATorch's DeepSpeed ZeRO optimizer keys (atorch/auto/opt_lib/zero_optimization.py, apply_ds_zero_wrapper)
#: and fairscale ShardedDataParallel's ``sync_models_at_startup``, with ATorch's defaults.
ZERO_OPTION_DEFAULTS = {
    "static_loss_scale": 1.0,
    "dynamic_loss_args": None,
    "clip_grad": 0,
    "cpu_offload": False,
    "allgather_bucket_size": 5e8,
    "reduce_bucket_size": 5e8,
    "sync_models_at_startup": True,
}
#: Which backends give each key a meaning (others refuse a non-default value, naming why).
_ZERO_OPTION_BACKENDS = {
    "static_loss_scale": ("deepspeed",),
    "dynamic_loss_args": (),
    "clip_grad": ("deepspeed",),
    "cpu_offload": ("deepspeed", "fsdp"),
    "allgather_bucket_size": ("deepspeed",),
    "reduce_bucket_size": ("deepspeed",),
    "sync_models_at_startup": ("fairscale", "fsdp"),
}
_ZERO_OPTION_WHY = {
    "static_loss_scale": "only DeepSpeed's ZeRO optimizer scales the loss itself; use amp('fp16') for a loss scaler",
    "dynamic_loss_args": "DeepSpeed's dynamic scaling keeps its defaults here; give static_loss_scale, or leave both "
    "out",
    "clip_grad": "add clip_grad(max_norm) to the plan instead",
    "cpu_offload": "this backend has no optimizer offload: use backend='deepspeed' (offload_optimizer) or "
    "zero2(backend='fsdp')",
    "allgather_bucket_size": "bucket sizes are DeepSpeed's; torch and fairscale pick their own",
    "reduce_bucket_size": "bucket sizes are DeepSpeed's; torch and fairscale pick their own",
    "sync_models_at_startup": "this backend always broadcasts rank 0's weights at start (ddp / DeepSpeed do it "
    "themselves)",
}


def zero_options(options, who: str, backend: str) -> tuple:
    """ATorch's zero keys as a sorted ``((key, value), ...)``.

    ConfigError for unknown keys or values this backend cannot honour.
    """
    items = dict(options or ())
    unknown = sorted(set(items) - set(ZERO_OPTION_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"{who} config key {unknown[0]!r}", items[unknown[0]], f"one of {', '.join(ZERO_OPTION_DEFAULTS)}"
        )
    for key, value in items.items():
        if value != ZERO_OPTION_DEFAULTS[key] and backend not in _ZERO_OPTION_BACKENDS[key]:
            raise ConfigError(
                f"{who}.{key} with backend={backend!r}",
                value,
                f"{ZERO_OPTION_DEFAULTS[key]!r}: {_ZERO_OPTION_WHY[key]}",
            )
    return tuple(sorted((k, v) for k, v in items.items() if v != ZERO_OPTION_DEFAULTS[k]))


def options_label(options) -> str:
    """``"; cpu_offload=True, ..."`` for describe(), or ``""``."""
    return "".join(f"; {k}={v!r}" for k, v in options)


def full_clip_grad_norm_(parameters, max_norm, norm_type=2.0) -> torch.Tensor:
    """torch's clip_grad_norm_ over gradients that may mix DTensors (sharded: FSDP2, tensor-parallel) and
    plain tensors (replicated on every rank), which torch refuses mixed; returns the total norm as a
    plain tensor (:func:`~composable_atorch.transforms.parallel.shared.grads.clip_grads_`)."""
    return clip_grads_(parameters, max_norm, norm_type)


def _full_clip_grad_norm_(self, max_norm, norm_type=2.0):
    """FSDP1's ``model.clip_grad_norm_(max_norm, norm_type)`` on an FSDP2 model: the full norm as a
    plain tensor (ATorch's scripts log it, e.g. with TensorBoard's ``add_scalar``, which takes no DTensor)."""
    return full_clip_grad_norm_(self.parameters(), max_norm, norm_type)


def give_clip_grad_norm(model: nn.Module) -> None:
    """The sharded root keeps FSDP1's clip_grad_norm_ method (FSDP2's fully_shard has none), unless
    the model defines its own."""
    if not hasattr(model, "clip_grad_norm_"):
        model.clip_grad_norm_ = types.MethodType(_full_clip_grad_norm_, model)
