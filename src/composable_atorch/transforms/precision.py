"""Precision: ``amp`` (autocast at the outer forward, with a grad scaler where needed) and ``half``.

Why the outputs go back to float32: the user's loss runs outside the model's forward, where no
autocast applies; computing a cross-entropy on bf16 logits loses accuracy for nothing (accelerate
does the same by default).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from composable_atorch.core.contract import Conflict, Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.runtime.optim import OptimizerHook
from composable_atorch.transforms._util import cast_floats, dtype_name, dtype_of


def _dtypes_differ(a, b) -> bool:
    """amp and half conflict only when they name different dtypes (bf16 weights under fp16 autocast...)."""
    return a.dtype != b.dtype


class GradScalerHook(OptimizerHook):
    """fp16 loss scaling: scale the loss, unscale before clipping, skip steps with inf/nan grads."""

    def __init__(self, device: str, shard_group=None):
        if shard_group is None:
            # also global for FSDP2's DTensor gradients (measured: an inf in one rank's shard is
            # found on every rank)
            self.scaler = torch.amp.GradScaler(device)
        else:
            # gradients sharded outside DTensor (fairscale): reduce the inf check over the group
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device, process_group=shard_group)
        self.skipped_steps = 0

    def scale_loss(self, loss):
        return self.scaler.scale(loss)

    def before_step(self, optimizer):
        self.scaler.unscale_(optimizer)

    def run_step(self, optimizer, closure=None):
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < scale:
            self.skipped_steps += 1
        return True

    def state_dict(self):
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state):
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)


def _all_finite(grads, shard_group=None) -> bool:
    """True when every gradient is finite on every rank holding a shard of it.

    Sharded gradients (DTensor, or fairscale's per-rank shards) are checked locally and the verdict
    reduced over their groups, so all ranks skip the same steps.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    bad = torch.stack([~torch.isfinite(g).all() for g in local]).any().float() if local else torch.zeros(())
    groups = {id(g.device_mesh): g.device_mesh for g in grads if isinstance(g, DTensor)}
    for mesh in groups.values():
        for dim in range(mesh.ndim):
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    if shard_group is not None:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=shard_group)
    return not bool(bad)


class NonfiniteSkipHook(OptimizerHook):
    """bf16 with ``skip_if_nonfinite``: no scaling (bf16 has fp32's range), but skip inf/nan steps."""

    def __init__(self, shard_group=None):
        self.skipped_steps = 0
        self.shard_group = shard_group

    def run_step(self, optimizer, closure=None):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not _all_finite(grads, self.shard_group):
            self.skipped_steps += 1
            return True  # handled: by not stepping
        return False

    def state_dict(self):
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state):
        self.skipped_steps = state.get("skipped_steps", 0)


@dataclass(frozen=True)
class Amp(Transform):
    """Automatic mixed precision: autocast around the outermost forward.

    fp16 always uses a grad scaler that skips a step whose gradients hold inf/nan and recovers on
    the next; bf16 skips such steps only with ``skip_if_nonfinite=True``.
    """

    name = "amp"
    aliases = ("amp_native",)
    contract = Contract(
        stage=Stage.FORWARD_PRECISION,
        conflicts=(
            Conflict(
                "half",
                "half casts the weights to one dtype while amp autocasts to another",
                "use the same dtype in amp and half, or drop one of them",
                when=_dtypes_differ,
            ),
        ),
        roles=("mixed_precision",),
    )

    dtype: str = "bf16"
    skip_if_nonfinite: bool = False

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype, "amp.dtype"))
        object.__setattr__(self, "skip_if_nonfinite", bool(self.skip_if_nonfinite) or self.dtype == "fp16")

    @classmethod
    def from_seed(cls, config=None):
        """Seed default is fp16; configs: ``"bf16"``, ``torch.bfloat16`` or ``{"dtype": ..., "skip_if_nonfinite": ...}``."""
        if config is None:
            return cls(dtype="fp16")
        if isinstance(config, dict):
            return super().from_seed({"dtype": "fp16", **config})
        return cls(dtype=config)

    @classmethod
    def candidates(cls, search):
        # fp16 is left out of the search: without a GPU's fp16 units it only adds a scaler
        return (cls(dtype="bf16"),)

    def describe(self):
        extra = ", grad scaler" if self.dtype == "fp16" else (", skip non-finite steps" if self.skip_if_nonfinite else "")
        return f"amp({self.dtype}{extra})"

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        model, device, dtype = state.model, ctx.env.device, dtype_of(self.dtype)
        if getattr(model.forward, "_composable_atorch_autocast", None) is not None:
            return state  # applied once per module (torch's @contract habit)
        inner = model.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            with torch.autocast(device_type=device, dtype=dtype):
                out = inner(*args, **kwargs)
            return cast_floats(out, torch.float32)

        forward._composable_atorch_autocast = dtype
        model.forward = forward
        state.note(self.name, f"autocast({device}, {self.dtype}) around {type(model).__name__}.forward; float outputs cast to float32")
        if self.dtype == "fp16":
            state.hooks.append(GradScalerHook(device, getattr(state.parallel, "grad_shard_group", None)))
            state.note(self.name, "grad scaler: loss scaled in optim.backward(), inf/nan steps skipped")
        elif self.skip_if_nonfinite:
            state.hooks.append(NonfiniteSkipHook(getattr(state.parallel, "grad_shard_group", None)))
            state.note(self.name, "steps with inf/nan gradients skipped")
        return state


def amp(dtype="bf16", *, skip_if_nonfinite: bool = False) -> Amp:
    """Mixed precision by autocast: ``amp("bf16")``, ``amp("fp16")`` or ``amp(torch.bfloat16)``."""
    return Amp(dtype=dtype, skip_if_nonfinite=skip_if_nonfinite)


amp_native = amp


@dataclass(frozen=True)
class Half(Transform):
    """Train in half precision: weights cast to bf16/fp16, float inputs cast, float outputs to fp32."""

    name = "half"
    contract = Contract(stage=Stage.HALF_CAST, roles=("half_precision",))

    dtype: str = "bf16"

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype, "half.dtype"))

    @classmethod
    def from_seed(cls, config=None):
        """Seed default is fp16; config ``"bf16"`` or ``"fp16"``."""
        return cls(dtype="fp16" if config is None else config)

    def describe(self):
        return f"half({self.dtype})"

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        dtype = dtype_of(self.dtype)
        model = state.model.to(dtype)
        model.register_forward_pre_hook(lambda m, args, kwargs: (cast_floats(args, dtype), cast_floats(kwargs, dtype)), with_kwargs=True)
        model.register_forward_hook(lambda m, args, out: cast_floats(out, torch.float32))
        state.model = model
        state.note(self.name, f"parameters and buffers cast to {self.dtype}; float inputs cast to {self.dtype}, float outputs to float32")
        return state


def half(dtype="bf16") -> Half:
    """Half-precision training: ``half("bf16")`` or ``half("fp16")``."""
    return Half(dtype=dtype)
