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
from composable_atorch.errors import ConfigError, NonFiniteError
from composable_atorch.runtime.optim import OptimizerHook
from composable_atorch.transforms._util import cast_floats, cast_module_, dtype_name, dtype_of
from composable_atorch.transforms.parallel.shared.grads import all_finite


def _dtypes_differ(a, b) -> bool:
    """amp and half conflict only when they name different dtypes (bf16 weights under fp16 autocast...)."""
    return a.dtype != b.dtype and getattr(a, "enabled", True)


class GradScalerHook(OptimizerHook):
    """fp16 loss scaling: scale the loss, unscale before clipping, skip steps with inf/nan grads.

    Every backward must scale (``optim.backward(loss)`` or a wrapped loss): ``needs_loss_hook``.
    """

    needs_loss_hook = True

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
        self._unscaled = False

    def scale_loss(self, loss):
        return self.scaler.scale(loss)

    def unscale(self, optimizer):
        """Unscale now (ATorch's ``optim.unscale_()`` before manual clipping); the step then does not again."""
        if not self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def before_step(self, optimizer):
        self.unscale(optimizer)

    def run_step(self, optimizer, closure=None):
        self._unscaled = False
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # the scale only drops when the scaler found inf/nan and skipped the step (ATorch's test)
        self.last_step_skipped = self.scaler.get_scale() < scale
        self.skipped_steps += int(self.last_step_skipped)
        return True

    def state_dict(self):
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state):
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)




class NonfiniteSkipHook(OptimizerHook):
    """No scaling (bf16 has fp32's range), but a step whose gradients hold inf/nan never reaches the
    weights: skipped (``optim.step_was_skipped``) or, with ``policy="raise"``, a
    :class:`~composable_atorch.errors.NonFiniteError` before anything changes.

    ``parallel`` is the plan's ParallelContext, read at each step: a sharding transform applied
    after this hook was added (half comes before them) sets the group the verdict is reduced over.
    """

    def __init__(self, parallel=None, policy: str = "skip"):
        self.skipped_steps = 0
        self.parallel = parallel
        self.policy = policy
        self.steps = 0
        self._owner = None

    def attach(self, optimizer):
        self._owner = optimizer

    def _engine_steps(self) -> bool:
        """An engine (DeepSpeed) runs backward and step itself, on gradients it partitions and keeps
        off ``p.grad``, with its own overflow check for fp16: checking ``p.grad`` here would see
        different gradients on different ranks and make them disagree."""
        hooks = getattr(self._owner, "hooks", ())
        return any(type(h).backward is not OptimizerHook.backward for h in hooks)

    def run_step(self, optimizer, closure=None):
        if self._engine_steps():
            return False
        self.steps += 1
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not all_finite(grads, self.parallel):
            if self.policy == "raise":  # raised by the optimizer once every hook has cleaned up
                self.pending_error = NonFiniteError(self.steps, "gradients")
            self.skipped_steps += 1
            self.last_step_skipped = True
            return True  # handled: by not stepping
        return False

    def state_dict(self):
        return {"skipped_steps": self.skipped_steps, "steps": self.steps}

    def load_state_dict(self, state):
        self.skipped_steps = state.get("skipped_steps", 0)
        self.steps = state.get("steps", 0)


#: what a step with inf/nan gradients does: "skip" it (default), "raise", or "allow" it (opt-out)
NONFINITE = ("skip", "raise", "allow")


def _nonfinite_policy(owner: str, nonfinite, skip_if_nonfinite) -> str:
    """One policy from ``nonfinite=`` and ATorch's ``skip_if_nonfinite``.

    ``skip_if_nonfinite=False`` was ATorch's default, and every plan file written before this
    policy holds it: it is not taken as an opt-out (that would let NaN through unasked); only
    ``nonfinite="allow"`` opts out.
    """
    if nonfinite is None:
        return "skip"
    if nonfinite not in NONFINITE:
        raise ConfigError(f"{owner}.nonfinite", nonfinite, "'skip' (default), 'raise' or 'allow' (the opt-out)")
    if skip_if_nonfinite is True and nonfinite != "skip":
        raise ConfigError(f"{owner}.skip_if_nonfinite", True, f"left out with nonfinite={nonfinite!r}")
    return nonfinite


def _add_nonfinite_hook(state: TrainState, owner: str, policy: str) -> None:
    """One check per plan (amp and half both ask for it); the note says what happens and how to opt out."""
    if policy == "allow":
        state.note(owner, "nonfinite='allow': a step with inf/nan gradients updates the weights (opted out)")
        return
    if any(isinstance(h, NonfiniteSkipHook) for h in state.hooks):
        return
    state.hooks.append(NonfiniteSkipHook(state.parallel, policy))
    what = (
        "skipped (optim.step_was_skipped is True; the weights and optimizer state stay as they were)"
        if policy == "skip"
        else "a NonFiniteError before the weights change"
    )
    state.note(owner, f"a step with inf/nan gradients is {what}; nonfinite='allow' opts out")


@dataclass(frozen=True)
class Amp(Transform):
    """Automatic mixed precision: autocast around the outermost forward.

    fp16 always uses a grad scaler that skips a step whose gradients hold inf/nan and recovers on
    the next. bf16 checks the gradients at each step: ``nonfinite="skip"`` (default) skips a step
    holding inf/nan, ``"raise"`` raises :class:`~composable_atorch.errors.NonFiniteError`, ``"allow"``
    lets it through (the explicit opt-out; ATorch's ``skip_if_nonfinite=False``, its default, is
    not one). A NaN loss would otherwise turn every weight into NaN without a word.
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
    #: ATorch's spelling, kept equal to ``nonfinite == "skip"``; False alone does not opt out
    skip_if_nonfinite: bool | None = None
    #: ATorch's ``amp_native`` ``enabled`` key (in its default config): False makes the step a no-op.
    enabled: bool = True
    nonfinite: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype, "amp.dtype"))
        if self.dtype == "fp16":
            # the scaler finds its scale by skipping overflowing steps: raising or allowing would be wrong
            if self.nonfinite not in (None, "skip"):
                raise ConfigError(
                    "amp.nonfinite", self.nonfinite, "'skip' with fp16 (its grad scaler skips inf/nan steps)"
                )
            policy = "skip"
        else:
            policy = _nonfinite_policy("amp", self.nonfinite, self.skip_if_nonfinite)
        object.__setattr__(self, "nonfinite", policy)
        object.__setattr__(self, "skip_if_nonfinite", policy == "skip")
        if not isinstance(self.enabled, bool):
            raise ConfigError("amp.enabled", self.enabled, "True or False")

    @classmethod
    def from_seed(cls, config=None):
        """ATorch's default is fp16; configs: ``"bf16"``, ``torch.bfloat16``.

        Or ``{"dtype": ..., "skip_if_nonfinite": ..., "enabled": ...}``.
        """
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
        if not self.enabled:
            return f"amp({self.dtype}, enabled=False: no autocast, no scaler)"
        extra = ", grad scaler" if self.dtype == "fp16" else _POLICY_LABEL[self.nonfinite]
        return f"amp({self.dtype}{extra})"

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        if not self.enabled:
            state.note(self.name, "enabled=False (ATorch's amp_native key): the forward stays float32, no grad scaler")
            return state
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
        state.note(
            self.name,
            f"autocast({device}, {self.dtype}) around {type(model).__name__}.forward; float outputs cast to float32",
        )
        if self.dtype == "fp16":
            state.hooks.append(GradScalerHook(device, getattr(state.parallel, "grad_shard_group", None)))
            state.note(
                self.name,
                "grad scaler: loss scaled in optim.backward() (or a loss wrapped by optim.wrap_loss / "
                "optim.loss_wrapper), inf/nan steps skipped; a step after an unwrapped loss.backward() raises",
            )
        else:
            _add_nonfinite_hook(state, self.name, self.nonfinite)
        return state


#: describe(): the default (skip) says nothing, so plan descriptions stay as they were
_POLICY_LABEL = {"skip": "", "raise": ", raise on non-finite steps", "allow": ", non-finite steps allowed"}


def amp(dtype="bf16", *, skip_if_nonfinite: bool | None = None, enabled: bool = True, nonfinite=None) -> Amp:
    """Mixed precision by autocast: ``amp("bf16")``, ``amp("fp16")`` or ``amp(torch.bfloat16)``.

    ``nonfinite``: ``"skip"`` (default) / ``"raise"`` / ``"allow"`` a step whose gradients hold inf/nan.
    """
    return Amp(dtype=dtype, skip_if_nonfinite=skip_if_nonfinite, enabled=enabled, nonfinite=nonfinite)


amp_native = amp


def _master_weights(a, b) -> bool:
    """half conflicts with sharded optimizers only with fp32 master weights."""
    return bool(getattr(a, "master_weights", False))


class MasterWeightsHook(OptimizerHook):
    """fp32 master weights for a half-precision model (ATorch's BF16Optimizer behaviour).

    The model's parameters stay in half precision; each keeps an fp32 copy here. At each real step
    the half gradients are copied to the copies, and for the step only (clipping, unscaling and the
    update included) the optimizer's param groups and state point at the fp32 copies; afterwards
    the copies are written back (rounded) into the model and the groups point at the model's
    parameters again. So outside a step the optimizer looks as the user built it (state dicts and
    DCP map by the model's parameters) while its state and updates stay in float32.
    """

    def __init__(self):
        self.masters: dict[int, torch.Tensor] = {}
        self._versions: dict[int, int] = {}  # each parameter's version counter after our last write
        self._swapped: list[tuple[dict, list]] = []

    def _master(self, p):
        """The fp32 copy of ``p``, made again from ``p`` when something else wrote ``p`` since our
        last step (a checkpoint load, a user's in-place init): a stale copy would undo that write."""
        m = self.masters.get(id(p))
        if m is None or m.shape != p.shape or self._versions.get(id(p)) != p._version:
            m = self.masters[id(p)] = p.detach().clone().float()
            self._versions[id(p)] = p._version
        return m

    def before_step(self, optimizer):
        self._swapped = []
        for group in optimizer.param_groups:
            params = group["params"]
            masters = []
            for p in params:
                m = self._master(p)
                m.grad = None if p.grad is None else p.grad.detach().float()
                st = optimizer.state.pop(p, None)
                if st is not None:
                    # state loaded by Optimizer.load_state_dict was cast to the half dtype: back to fp32
                    optimizer.state[m] = {
                        k: v.float() if k != "step" and torch.is_tensor(v) and v.is_floating_point() else v
                        for k, v in st.items()
                    }
                masters.append(m)
            group["params"] = masters
            self._swapped.append((group, params))

    def after_step(self):
        swapped, self._swapped = self._swapped, []
        state = self._owner.optimizer.state
        for group, params in swapped:
            for p, m in zip(params, group["params"], strict=True):
                with torch.no_grad():
                    p.copy_(m)  # rounded to the model's dtype
                self._versions[id(p)] = p._version
                m.grad = None
                if m in state:  # the state goes back to the model's parameter (fp32 tensors)
                    state[p] = state.pop(m)
            group["params"] = params

    def attach(self, optimizer):
        self._owner = optimizer

    # state_dict: nothing (the default). Checkpoints hold JSON hook state; the fp32 copies are made
    # again from the loaded model weights (their bits below the half dtype are not saved).


@dataclass(frozen=True)
class Half(Transform):
    """Train in half precision: weights cast to bf16/fp16, float inputs cast, float outputs to fp32.

    ``master_weights=True`` keeps an fp32 copy of every parameter the optimizer steps on
    (:class:`MasterWeightsHook`, ATorch's BF16Optimizer): the model computes in half precision,
    the updates accumulate in float32, so small updates are not rounded away. The default (None)
    is ATorch's: bf16 gets master weights (pure-bf16 AdamW silently loses updates below bf16's
    8-bit mantissa) unless a step of the plan shards the optimizer state, whose fp32 state then is
    the master copy; fp16 gets none. ``master_weights=False`` keeps pure half-precision training.
    ``nonfinite`` is as amp's: a step with inf/nan gradients is skipped by default (``"raise"``,
    or ``"allow"`` to opt out); fp16 weights without a grad scaler overflow easily, so it applies
    to fp16 too.
    """

    name = "half"
    contract = Contract(
        stage=Stage.HALF_CAST,
        conflicts=(
            Conflict(
                "optimizer_state_sharding",
                "half's fp32 master weights swap the optimizer's parameters at each step, which a sharded "
                "optimizer (zero1 / zero2 / fsdp / DeepSpeed) does not see: the update would be lost",
                "drop master_weights and use amp(dtype) with the sharding transform (its fp32 shards are the master "
                "weights)",
                when=_master_weights,
            ),
        ),
        roles=("half_precision",),
    )

    dtype: str = "bf16"
    master_weights: bool | None = None
    nonfinite: str = "skip"

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype, "half.dtype"))
        object.__setattr__(self, "nonfinite", _nonfinite_policy("half", self.nonfinite, None))
        if self.master_weights is not None and not isinstance(self.master_weights, bool):
            raise ConfigError("half.master_weights", self.master_weights, "True, False, or None (ATorch's default)")

    @classmethod
    def from_seed(cls, config=None):
        """ATorch's default is fp16; config ``"bf16"``, ``"fp16"`` or ``{"dtype": ..., "master_weights": ...}``."""
        if isinstance(config, dict):
            return super().from_seed({"dtype": "fp16", **config})
        return cls(dtype="fp16" if config is None else config)

    def describe(self):
        label = _POLICY_LABEL[self.nonfinite]
        if self.master_weights is None and self.dtype == "bf16":  # ATorch's default, decided at apply time
            return f"half(bf16{label}) with fp32 master weights unless the optimizer state is sharded"
        return f"half({self.dtype}{', fp32 master weights' if self.master_weights else ''}{label})"

    def _use_masters(self, ctx: ApplyContext) -> bool:
        if self.master_weights is not None or self.dtype != "bf16":
            return bool(self.master_weights)
        # ATorch's default: a sharded optimizer's fp32 state already is the master copy
        return not any("optimizer_state_sharding" in t.contract.owns for t in ctx.plan.transforms)

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        dtype = dtype_of(self.dtype)
        model = cast_module_(state.model, dtype)
        model.register_forward_pre_hook(
            lambda m, args, kwargs: (cast_floats(args, dtype), cast_floats(kwargs, dtype)), with_kwargs=True
        )
        model.register_forward_hook(lambda m, args, out: cast_floats(out, torch.float32))
        state.model = model
        state.note(
            self.name,
            f"parameters and buffers cast to {self.dtype}; float inputs cast to {self.dtype}, float outputs to float32",
        )
        if self._use_masters(ctx):
            state.hooks.append(MasterWeightsHook())
            state.note(
                self.name, "fp32 master weights: the optimizer steps on float32 copies, copied back after each step"
            )
        elif self.master_weights is None and self.dtype == "bf16":
            state.note(self.name, "no fp32 master weights: the sharded optimizer's fp32 state is the master copy")
        _add_nonfinite_hook(state, self.name, self.nonfinite)
        return state


def half(dtype="bf16", *, master_weights: bool | None = None, nonfinite: str = "skip") -> Half:
    """Half-precision training: ``half("bf16")`` (fp32 master weights, as ATorch), ``half("fp16")``,
    ``half("bf16", master_weights=False)`` (pure bf16).

    ``nonfinite``: ``"skip"`` (default) / ``"raise"`` / ``"allow"`` a step whose gradients hold inf/nan.
    """
    return Half(dtype=dtype, master_weights=master_weights, nonfinite=nonfinite)
