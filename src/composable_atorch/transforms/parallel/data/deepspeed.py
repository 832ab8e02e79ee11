"""DeepSpeed backends of zero1 / zero2 / fsdp: ZeRO stages 1, 2 and 3 in a DeepSpeed engine.

``zero1(backend="deepspeed")`` (and the zero2 / fsdp ones) resolve, at compose time, to the
variants below. They keep the transform's name (``zero1`` ...) but carry the engine's contract:
the engine owns backward, gradient sync, the step and clipping, so it conflicts with ddp, and
with accumulate, half and fp16 amp, whose loop hooks would act on tensors the engine has already
flattened and partitioned. The user's loop stays ``optim.backward(loss); optim.step();
optim.zero_grad()``: :class:`DeepSpeedHook` forwards those calls to the engine.

On this CPU DeepSpeed detects its CPU accelerator and uses gloo by itself, so no environment
variable is set here (``DS_ACCELERATOR=cpu`` forces it where detection guesses wrong). Its first
``initialize`` JIT-compiles a shared-memory comm op (about a minute; cached under
``~/.cache/torch_extensions``). The user's torch optimizer is passed to the engine, never
DeepSpeed's fused Adam (another cold compile).

The engine is a wrapper module that prefixes parameter names with ``module.``; the plan maps
them back for the optimizer and saved state.
"""

from __future__ import annotations

from composable_atorch.core.contract import Conflict, Contract, Cost, Package, Stage
from composable_atorch.core.transform import ApplyContext, TrainState
from composable_atorch.errors import ConfigError, RequirementError
from composable_atorch.runtime.optim import NAME_PREFIX_ATTR, OptimizerHook
from composable_atorch.transforms.parallel.data.common import IMPLIES_PARALLEL_MODE, ZERO_DIM_DEEPSPEED, options_label
from composable_atorch.transforms.parallel.data.data_parallel import Zero1
from composable_atorch.transforms.parallel.data.sharding import Fsdp, Zero2
from composable_atorch.transforms.parallel.shared.sync import GRAD_SYNC, OPTIMIZER_STATE_SHARDING, parallel_context
from composable_atorch.transforms.policy import PRECISION_READS, PrecisionPolicy

_ENGINE = "the DeepSpeed engine runs backward, gradient sync and the step itself"


def _fp16(_mine, amp) -> bool:
    return getattr(amp, "dtype", None) == "fp16"


def deepspeed_contract() -> Contract:
    return Contract(
        stage=Stage.DATA_PARALLEL,
        owns=(GRAD_SYNC, OPTIMIZER_STATE_SHARDING),
        roles=("deepspeed_engine", "data_parallel", "zero"),
        reads=("clip_grad", *PRECISION_READS),
        renames=False,
        requires=(Package(name="deepspeed", extra="deepspeed"),),
        implies=(IMPLIES_PARALLEL_MODE,),
        conflicts=(
            Conflict("ddp", f"{_ENGINE}; DDP would all-reduce a second time", "drop ddp"),
            ZERO_DIM_DEEPSPEED,
            Conflict(
                "accumulate",
                f"{_ENGINE}, accumulating with its own gradient_accumulation_steps, not wired to accumulate here",
                "drop accumulate, or use a torch backend (zero2(backend='fsdp'))",
            ),
            Conflict(
                "amp",
                "fp16 loss scaling must happen inside the engine, which partitions the gradients",
                "use amp('bf16'), or a torch backend for fp16",
                when=_fp16,
            ),
        ),
        # the engine flattens real parameter storage and builds its C++ ops on first use: it cannot
        # run on the estimate's fake tensors, which refuses the plan (a typed error) rather than
        # report a figure without the engine's sharding
        cost=Cost(simulated=False),
    )


class DeepSpeedHook(OptimizerHook):
    """``optim.backward / step / zero_grad`` go to the engine."""

    def __init__(self, engine, clips_gradients: bool):
        self.engine = engine
        self.clips_gradients = clips_gradients

    def backward(self, loss, **kwargs):
        self.engine.backward(loss, **kwargs)
        return True

    def run_step(self, optimizer, closure=None):
        if closure is not None:
            raise ConfigError("optim.step(closure)", closure, "no closure: the DeepSpeed engine steps without one")
        self.engine.step()
        return True

    def zero_grad(self, optimizer, set_to_none):
        self.engine.zero_grad()
        return True


def check_half_supported(half: str, who: str) -> None:
    """DeepSpeed's accelerator refuses a half dtype the device has no kernels for (fp16 on a CPU
    without AVX512-FP16/AMX-FP16): say so before the engine is built, with the fix."""
    import torch
    from deepspeed.accelerator import get_accelerator

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[half]
    accel = get_accelerator()
    if dtype not in accel.supported_dtypes():
        other = "bf16" if half == "fp16" else "fp32"
        raise RequirementError(
            who,
            f"a device on which DeepSpeed supports {half} (DeepSpeed's {accel.device_name()} accelerator here does "
            "not)",
            f"use half('{other}') or a torch backend ({who}(backend='torch')), or run on a device with {half} kernels",
        )


def engine_config(stage: int, per_rank_batch: int, data_size: int, clip: float | None, half: str | None = None) -> dict:
    """The DeepSpeed config for one ZeRO stage with the loader's batch (strong scaling).

    ``half`` (``"bf16"`` / ``"fp16"``, from a ``half`` step in the plan) turns on DeepSpeed's own
    half-precision mode: the engine keeps fp32 master weights in its optimizer partitions and
    trains the module in ``half`` (ATorch's DeepSpeed recipe: ``half`` + ZeRO). fp16 uses
    DeepSpeed's dynamic loss scaling.
    """
    config = {
        "train_micro_batch_size_per_gpu": per_rank_batch,
        "train_batch_size": per_rank_batch * data_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(clip or 0.0),
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if half == "bf16":
        config["bf16"] = {"enabled": True}
    elif half == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0}
    return config


def apply_options(config: dict, options: dict, clip_transform: float | None, who: str) -> list[str]:
    """ATorch's zero keys onto the DeepSpeed config (in place); returns explain() lines."""
    notes = []
    zero = config["zero_optimization"]
    if options.get("cpu_offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        # the plan keeps the user's torch optimizer (ATorch passes its own); DeepSpeed otherwise insists on its CPU Adam
        config["zero_force_ds_cpu_optimizer"] = False
        notes.append("cpu_offload: optimizer state offloaded to the CPU (offload_optimizer), stepped by your optimizer")
    for key in ("allgather_bucket_size", "reduce_bucket_size"):
        if key in options:
            zero[key] = int(options[key])
            notes.append(f"{key}={int(options[key])}")
    if "clip_grad" in options:
        if clip_transform is not None and float(options["clip_grad"]) != float(clip_transform):
            raise ConfigError(
                f"{who}.clip_grad",
                options["clip_grad"],
                f"the same max_norm as clip_grad({clip_transform:g}) in the plan, or leave one out",
            )
        config["gradient_clipping"] = float(options["clip_grad"])
        notes.append(f"clip_grad={float(options['clip_grad']):g} (gradient_clipping)")
    if "static_loss_scale" in options:
        if "fp16" in config:
            config["fp16"]["loss_scale"] = float(options["static_loss_scale"])
            notes.append(f"static loss scale {float(options['static_loss_scale']):g} (fp16)")
        else:
            notes.append(
                f"static_loss_scale={options['static_loss_scale']!r} read; DeepSpeed scales the loss only in fp16, so "
                "it has no effect here"
            )
    return notes


def apply_engine(stage: int, who: str, state: TrainState, ctx: ApplyContext, options: dict | None = None) -> TrainState:
    import deepspeed
    import torch.distributed as dist

    pc = parallel_context(state, who)
    if not pc.distributed:
        raise RequirementError(
            who,
            "a process group (DeepSpeed runs in a launched job)",
            "launch with `python -m composable_atorch launch --nproc N train.py`",
        )
    if pc.data_size != dist.get_world_size():
        raise ConfigError(
            "parallel_mode.groups",
            pc.layout.dims,
            f"data parallelism over the whole world ({dist.get_world_size()}) for DeepSpeed ZeRO",
        )
    if state.optim is None:
        raise ConfigError("optim", None, "a torch optimizer: the DeepSpeed engine steps it")
    per_rank = state.loader.batch_size if state.loader is not None and state.loader.batch_size else 1
    clip = ctx.find("clip_grad")
    policy = PrecisionPolicy.of(ctx)
    half = policy.name if policy.source == "half" else None
    if half is not None:
        check_half_supported(half, who)
    config = engine_config(stage, per_rank, pc.data_size, clip.max_norm if clip is not None else None, half)
    option_notes = apply_options(config, dict(options or {}), clip.max_norm if clip is not None else None, who)
    engine, ds_optim, _, _ = deepspeed.initialize(
        model=state.model, optimizer=state.optim, config=config, dist_init_required=False
    )
    setattr(engine, NAME_PREFIX_ATTR, "module.")
    state.model, state.optim = engine, ds_optim
    state.hooks.append(DeepSpeedHook(engine, clips_gradients=bool(config["gradient_clipping"])))
    state.note(
        who,
        f"DeepSpeed ZeRO-{stage} engine over {pc.data_size} ranks, micro-batch {per_rank}, {type(ds_optim).__name__} "
        "around the user's optimizer",
    )
    if half is not None:
        state.note(
            who,
            f"half({half}) mapped onto DeepSpeed's {half} mode: the engine trains in {half} with fp32 master weights "
            "in its optimizer",
        )
    for line in option_notes:
        state.note(who, line)
    if clip is not None:
        state.note(who, f"clip_grad's max_norm {clip.max_norm:g} passed to the engine (gradient_clipping)")
    return state


class DeepSpeedZero1(Zero1, backend="deepspeed"):
    contract = deepspeed_contract()
    resolve_note = "DeepSpeed engine (ZeRO-1) owns backward, gradient sync and step"

    def describe(self):
        return f"zero1(DeepSpeed ZeRO-1 engine{options_label(self.options)})"

    def apply(self, state, ctx):
        return apply_engine(1, self.name, state, ctx, dict(self.options))


class DeepSpeedZero2(Zero2, backend="deepspeed"):
    contract = deepspeed_contract()
    resolve_note = "DeepSpeed engine (ZeRO-2) owns backward, gradient sync and step"

    def describe(self):
        return f"zero2(DeepSpeed ZeRO-2 engine{options_label(self.options)})"

    def apply(self, state, ctx):
        return apply_engine(2, self.name, state, ctx, dict(self.options))


class DeepSpeedFsdp(Fsdp, backend="deepspeed"):
    contract = deepspeed_contract()
    resolve_note = "DeepSpeed engine (ZeRO-3) owns backward, gradient sync and step"

    def describe(self):
        return "fsdp(DeepSpeed ZeRO-3 engine)"

    def apply(self, state, ctx):
        if self.wrap or self.min_params or self.ignored:
            state.note(self.name, "wrap / min_params / ignored are FSDP2 options; ZeRO-3 partitions every parameter")
        return apply_engine(3, self.name, state, ctx, {"cpu_offload": True} if self.cpu_offload else {})
