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

from composable_atorch.core.contract import Conflict, Contract, Package, Stage
from composable_atorch.core.transform import ApplyContext, TrainState
from composable_atorch.errors import ConfigError, RequirementError
from composable_atorch.runtime.optim import NAME_PREFIX_ATTR, OptimizerHook
from composable_atorch.transforms.parallel.data_parallel import IMPLIES_PARALLEL_MODE, Zero1, parallel_context
from composable_atorch.transforms.parallel.sharding import Fsdp, Zero2

_ENGINE = "the DeepSpeed engine runs backward, gradient sync and the step itself"


def _fp16(_mine, amp) -> bool:
    return getattr(amp, "dtype", None) == "fp16"


def deepspeed_contract() -> Contract:
    return Contract(
        stage=Stage.DATA_PARALLEL,
        owns=("grad_sync", "optimizer_state_sharding"),
        roles=("deepspeed_engine", "data_parallel", "zero"),
        requires=(Package(name="deepspeed", extra="deepspeed"),),
        implies=(IMPLIES_PARALLEL_MODE,),
        conflicts=(
            Conflict("ddp", f"{_ENGINE}; DDP would all-reduce a second time", "drop ddp"),
            Conflict("accumulate", f"{_ENGINE}, accumulating with its own gradient_accumulation_steps, not wired to accumulate here", "drop accumulate, or use a torch backend (zero2(backend='fsdp'))"),
            Conflict("half", "DeepSpeed keeps fp32 master weights in its own bf16/fp16 mode; a half-cast model bypasses it", "drop half (amp('bf16') works with DeepSpeed)"),
            Conflict("amp", "fp16 loss scaling must happen inside the engine, which partitions the gradients", "use amp('bf16'), or a torch backend for fp16", when=_fp16),
        ),
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


def engine_config(stage: int, per_rank_batch: int, data_size: int, clip: float | None) -> dict:
    """The DeepSpeed config for one ZeRO stage, fp32, with the loader's batch (strong scaling)."""
    return {
        "train_micro_batch_size_per_gpu": per_rank_batch,
        "train_batch_size": per_rank_batch * data_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(clip or 0.0),
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def apply_engine(stage: int, who: str, state: TrainState, ctx: ApplyContext) -> TrainState:
    import deepspeed
    import torch.distributed as dist

    pc = parallel_context(state, who)
    if not pc.distributed:
        raise RequirementError(who, "a process group (DeepSpeed runs in a launched job)", "launch with `python -m composable_atorch launch --nproc N train.py`")
    if pc.data_size != dist.get_world_size():
        raise ConfigError("parallel_mode.groups", pc.layout.dims, f"data parallelism over the whole world ({dist.get_world_size()}) for DeepSpeed ZeRO")
    if state.optim is None:
        raise ConfigError("optim", None, "a torch optimizer: the DeepSpeed engine steps it")
    per_rank = state.loader.batch_size if state.loader is not None and state.loader.batch_size else 1
    clip = ctx.find("clip_grad")
    config = engine_config(stage, per_rank, pc.data_size, clip.max_norm if clip is not None else None)
    engine, ds_optim, _, _ = deepspeed.initialize(model=state.model, optimizer=state.optim, config=config, dist_init_required=False)
    setattr(engine, NAME_PREFIX_ATTR, "module.")
    state.model, state.optim = engine, ds_optim
    state.hooks.append(DeepSpeedHook(engine, clips_gradients=clip is not None))
    state.note(who, f"DeepSpeed ZeRO-{stage} engine over {pc.data_size} ranks, micro-batch {per_rank}, {type(ds_optim).__name__} around the user's optimizer")
    if clip is not None:
        state.note(who, f"clip_grad's max_norm {clip.max_norm:g} passed to the engine (gradient_clipping)")
    return state


class DeepSpeedZero1(Zero1):
    contract = deepspeed_contract()

    def describe(self):
        return "zero1(DeepSpeed ZeRO-1 engine)"

    def apply(self, state, ctx):
        return apply_engine(1, self.name, state, ctx)


class DeepSpeedZero2(Zero2):
    contract = deepspeed_contract()

    def describe(self):
        return "zero2(DeepSpeed ZeRO-2 engine)"

    def apply(self, state, ctx):
        return apply_engine(2, self.name, state, ctx)


class DeepSpeedFsdp(Fsdp):
    contract = deepspeed_contract()

    def describe(self):
        return "fsdp(DeepSpeed ZeRO-3 engine)"

    def apply(self, state, ctx):
        if self.wrap or self.min_params or self.ignored:
            state.note(self.name, "wrap / min_params / ignored are FSDP2 options; ZeRO-3 partitions every parameter")
        return apply_engine(3, self.name, state, ctx)
