"""``ds_3d_parallel`` (``deepspeed_3d_parallel``).

DeepSpeed pipeline x tensor x data parallelism from an unmodified model.

    with record_module_init():
        meta_model = LlamaForCausalLM(LlamaConfig(...))            # nothing allocated
    cfg = DeepSpeed3DParallelConfig(tpinfo=llama_tpinfo(), ds_config={...})
    status, result, _ = auto_accelerate(meta_model, torch.optim.AdamW, loss_func=my_loss,
        load_strategy=[("parallel_mode", ([("tensor", 2), ("data", 1), ("pipeline", 2)], None)),
                       ("deepspeed_3d_parallel", cfg)])
    loss = result.model.train_batch(data_iter)                      # a DeepSpeed PipelineEngine

The degrees are ``parallel_mode``'s. The model's module list becomes DeepSpeed layer specs
(:mod:`.ds3d_build`): each rank builds only its stage's layers, sharded Megatron-style over the
``tensor`` dimension (:mod:`.ds3d_tp`, which says why not DTensor), and DeepSpeed's own
``PipelineModule`` and ``PipelineEngine`` run the schedule, tie the embedding across the first and
last stages and average gradients over the ``data`` dimension (the DeepSpeed side lives in
:mod:`.ds3d_engine`). Its process topology is built from
the same layout as the device mesh, so DeepSpeed's groups are parallel_mode's groups.

The DeepSpeed config is derived from the plan: the micro-batch and accumulation steps from the
loader's per-rank batch (``gradient_accumulation_steps`` is the number of micro-batches one
``train_batch`` pipelines; default: one per stage), bf16 / fp16 from ``half``, clipping from
``clip_grad``, ZeRO stage 0 (DeepSpeed's pipeline runs ZeRO 0 or 1). A user ``ds_config`` (a dict
or a JSON path) fills in the rest; a key that contradicts the plan is a ConfigError naming it.

``train_step(engine, optim, inputs, targets, loss_fn)`` also trains it (it calls ``train_batch``
on the batch cut into micro-batches), so the plan trains in the shared loop too.

A config holding functions (patchers, a logit helper, a batch function) is not JSON: such a plan
is applied on every rank from the strategy each rank loaded, and cannot be saved as a strategy file.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

from composable_atorch.core.contract import Conflict, Contract, Cost, Package, Stage, mesh_dim_implication
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError, RequirementError
from composable_atorch.runtime.axes import DATA, PIPELINE, TENSOR
from composable_atorch.runtime.optim import NAME_PREFIX_ATTR, named_parameters
from composable_atorch.transforms._util import is_function as _is_function
from composable_atorch.transforms.parallel.data.deepspeed import check_half_supported
from composable_atorch.transforms.parallel.ds3d.build import (
    StageBuilder,
    block_class,
    builtin_patcher,
    check_model,
    default_logit_helper,
    layer_specs,
    module_list,
    pipeline_module_class,
    vocab_parallel_logit_helper,
)
from composable_atorch.transforms.parallel.ds3d.engine import (
    Ds3dHook,
    Ds3dRunner,
    check_ds_config_path,
    engine_config,
    engine_notes,
    exact_clipping,
    frozen,
    read_ds_config,
    stage_optimizer,
    topology,
)
from composable_atorch.transforms.parallel.ds3d.tp import RandomStream
from composable_atorch.transforms.parallel.shared.sync import GRAD_SYNC, OPTIMIZER_STATE_SHARDING, parallel_context
from composable_atorch.transforms.parallel.tensor.planner import TPInfo, name_matches, normalize_plan
from composable_atorch.transforms.policy import PRECISION_READS, PrecisionPolicy

_ENGINE = "ds_3d_parallel's DeepSpeed pipeline engine averages gradients over the data dimension and steps itself"
_BUILDS = "ds_3d_parallel builds every layer again from its recorded init args"


def _layer_rewrite(ctx: ApplyContext):
    """module_replace's pairs on one built layer (ATorch's ds_3d example asks for both): the meta
    model's swaps are lost when a stage builds its layers again from their recorded init args, so
    the builder applies the same replacement to each layer before sharding it."""
    replace = ctx.find("module_replace")
    if replace is None:
        return None
    step_ctx = ctx.for_step(replace)
    return lambda module: replace.rewrite(module, step_ctx)


class DeepSpeed3DParallelConfig:
    """ATorch's configuration (names and defaults verbatim).

    * ``base_seed``: seeds each layer's initialisation (``base_seed + layer index``, the same on every
      rank that builds it) and the dropout streams named in the TPInfo;
    * ``tpinfo``: a :class:`TPInfo` (what is sharded over the ``tensor`` dimension);
    * ``custom_patcher``: ``{module name in the module list: patch_fn(forward, module) -> forward}``;
    * ``tie_first``: the first module (vocabulary embedding) also computes the logits at the end;
    * ``logit_helper``: ``helper(embedding, lm_output) -> logits`` for the tied embedding (default:
      vocabulary-parallel when the TPInfo shards the vocabulary);
    * ``ds_config``: a dict or a JSON file path; ``batch_fn``: a batch -> ``((inputs,), (labels,))``.
    """

    def __init__(
        self,
        base_seed=1234,
        tpinfo=None,
        custom_patcher=None,
        tie_first=True,
        logit_helper=None,
        ds_config=None,
        batch_fn=None,
    ):
        self.base_seed = base_seed
        self.tpinfo = tpinfo if tpinfo is not None else TPInfo()
        self.custom_patcher = custom_patcher if custom_patcher is not None else dict()
        self.tie_first = tie_first
        vocab = isinstance(self.tpinfo, TPInfo) and self.tpinfo.is_vocab_parallelled
        self.logit_helper = (
            logit_helper if logit_helper is not None else (vocab_parallel_logit_helper if vocab else None)
        )
        self.ds_config = ds_config
        self.batch_fn = batch_fn if batch_fn is not None else identity_batch


def identity_batch(batch):
    """ATorch's default ``batch_fn`` (the batch as the loader gives it). A named function, not a
    lambda, so a plan built from the config stays JSON-serialisable."""
    return batch


def _seed(*parts) -> int:
    """A seed from ``parts``, equal on every rank that passes equal parts (Python's hash() is salted per process)."""
    return zlib.crc32(repr(parts).encode()) + int(parts[0])


def _no_zero_dim(_mine, pm) -> bool:
    return any(n == "zero" and s > 1 for n, s in pm.groups) or pm.rank_order is not None


@dataclass(frozen=True)
class DeepSpeed3DParallel(Transform):
    """DeepSpeed pipeline x tensor x data parallelism; degrees from ``parallel_mode`` (see the module doc)."""

    name = "ds_3d_parallel"
    aliases = ("deepspeed_3d_parallel",)
    contract = Contract(
        stage=Stage.TENSOR_PARALLEL,
        owns=(GRAD_SYNC, OPTIMIZER_STATE_SHARDING),
        roles=("model_parallel", "pipeline", "deepspeed_engine"),
        # module_replace: its pairs are applied again to each layer built from the recorded init args
        reads=("clip_grad", "module_replace", *PRECISION_READS),
        renames=True,  # a stage holds its layers only, named by DeepSpeed's layer index
        cost=Cost(simulated=False),  # DeepSpeed's engine cannot run on the estimate's fake tensors
        requires=(Package(name="deepspeed", extra="deepspeed"),),
        implies=(mesh_dim_implication(PIPELINE, "the pipeline, tensor and data degrees are parallel_mode's groups"),),
        uses=(PIPELINE, TENSOR, DATA),
        conflicts=(
            Conflict("ddp", f"{_ENGINE}; DDP would all-reduce a second time", "drop ddp"),
            Conflict("fsdp", f"{_ENGINE}; FSDP would shard and reduce the same parameters again", "drop fsdp"),
            Conflict(
                "zero1",
                f"{_ENGINE}; its ZeRO stage is set in ds_config (zero_optimization.stage 0 or 1)",
                "drop zero1; put {'zero_optimization': {'stage': 1}} in ds_config",
            ),
            Conflict(
                "zero2",
                f"{_ENGINE}; DeepSpeed's pipeline supports ZeRO stages 0 and 1 only",
                "drop zero2; use zero_optimization.stage 1 in ds_config",
            ),
            Conflict(
                "tensor_parallel",
                "ds_3d_parallel shards the stage layers itself (Megatron-style, for DeepSpeed's engine); DTensor "
                "layers would be sharded twice",
                "drop tensor_parallel; pass DeepSpeed3DParallelConfig(tpinfo=...)",
            ),
            Conflict(
                "pipeline_parallel",
                "ds_3d_parallel cuts the stages itself, with DeepSpeed's pipeline engine",
                "drop pipeline_parallel (or drop ds_3d_parallel to use torch's pipelining)",
            ),
            Conflict(
                "mixed_parallel",
                "both lay out tensor x pipeline x data over the same ranks with different engines",
                "keep one of them",
            ),
            Conflict(
                "accumulate",
                "the pipeline accumulates over gradient_accumulation_steps micro-batches inside train_batch",
                "drop accumulate; set gradient_accumulation_steps in ds_config",
            ),
            Conflict(
                "amp",
                "DeepSpeed trains in its own precision (its bf16 / fp16 modes); autocast around the engine is not "
                "applied by train_batch",
                "use half('bf16') in the plan, or bf16 / fp16 in ds_config",
            ),
            Conflict(
                "checkpoint",
                f"{_BUILDS}, so wrappers put on the model's blocks are lost",
                "drop checkpoint; set pipeline.activation_checkpoint_interval in ds_config",
            ),
            Conflict("compile", f"{_BUILDS}; a compiled module would be dropped", "drop compile"),
            Conflict(
                "parallel_mode",
                "DeepSpeed's topology is pipe x data x model: no 'zero' dimension and no custom rank order",
                "use ('tensor', t), ('data', d), ('pipeline', p) without rank_order",
                when=_no_zero_dim,
            ),
        ),
    )

    base_seed: int = 1234
    tpinfo: Any = ()
    custom_patcher: Any = ()
    tie_first: bool = True
    logit_helper: Any = None
    ds_config: Any = None
    batch_fn: Any = None

    def __post_init__(self):
        if isinstance(self.base_seed, bool) or not isinstance(self.base_seed, int):
            raise ConfigError("DeepSpeed3DParallelConfig.base_seed", self.base_seed, "an integer")
        tp = self.tpinfo
        if tp is None or (isinstance(tp, TPInfo) and not tp.entries) or tp == ():
            tp = ()
        else:
            tp = normalize_plan(tp)
            if tp == "auto":
                raise ConfigError("DeepSpeed3DParallelConfig.tpinfo", "auto", "a TPInfo (ATorch's manual form)")
        object.__setattr__(self, "tpinfo", tp)
        patchers = self.custom_patcher
        if patchers is None:
            patchers = ()
        elif isinstance(patchers, dict):
            patchers = tuple(sorted(patchers.items()))
        if not isinstance(patchers, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and _is_function(p[1]) for p in patchers
        ):
            raise ConfigError(
                "DeepSpeed3DParallelConfig.custom_patcher",
                self.custom_patcher,
                "a dict {module name: patch_fn(forward, module) -> forward}",
            )
        object.__setattr__(self, "custom_patcher", patchers)
        if not isinstance(self.tie_first, bool):
            raise ConfigError("DeepSpeed3DParallelConfig.tie_first", self.tie_first, "True or False")
        for field in ("logit_helper", "batch_fn"):
            if getattr(self, field) is not None and not _is_function(getattr(self, field)):
                raise ConfigError(
                    f"DeepSpeed3DParallelConfig.{field}", getattr(self, field), "None or a function (not a class)"
                )
        if isinstance(self.ds_config, dict):
            object.__setattr__(self, "ds_config", frozen(self.ds_config))
        else:
            check_ds_config_path(self.ds_config)  # a bad path fails here, before any work; read when applied

    @classmethod
    def from_seed(cls, config=None):
        if isinstance(config, DeepSpeed3DParallelConfig):
            helper = config.logit_helper if config.logit_helper is not vocab_parallel_logit_helper else None
            return cls(
                base_seed=config.base_seed,
                tpinfo=config.tpinfo,
                custom_patcher=config.custom_patcher,
                tie_first=config.tie_first,
                logit_helper=helper,
                ds_config=config.ds_config,
                batch_fn=None if config.batch_fn is identity_batch else config.batch_fn,
            )
        return super().from_seed(config)

    def describe(self):
        parts = [f"{len(self.tpinfo)} TPInfo entries" if self.tpinfo else "no tensor sharding"]
        if self.custom_patcher:
            parts.append(f"{len(self.custom_patcher)} custom patchers")
        parts.append("first module tied to the logits" if self.tie_first else "untied")
        if self.ds_config is not None:
            parts.append(
                "ds_config file" if isinstance(self.ds_config, str) else f"ds_config keys {sorted(self.ds_config)}"
            )
        return f"ds_3d_parallel(DeepSpeed pipeline engine; {', '.join(parts)}; base_seed {self.base_seed})"

    # -- checks (every one before any work) --------------------------------------------------
    def _tp_placements(self, model, degree: int):
        """``(shard, shrink, drops)`` over the meta model's qualified names.

        TensorParallelPlanError if the TPInfo names no module.
        """
        if not self.tpinfo:
            if degree > 1:
                raise ConfigError(
                    "DeepSpeed3DParallelConfig.tpinfo",
                    "empty",
                    f"a TPInfo saying what to shard over the tensor dimension of {degree}",
                )
            return {}, {}, {}
        from composable_atorch.transforms.parallel.tensor.transform import TensorParallel

        config = getattr(model, "config", None)
        for attr in ("num_attention_heads", "num_key_value_heads", "n_head"):
            heads = getattr(config, attr, None)
            if isinstance(heads, int) and heads % degree:
                raise ConfigError(
                    f"parallel_mode tensor size (model config {attr} = {heads})",
                    degree,
                    "a divisor of the head count: each tensor rank keeps whole heads",
                )
        shard, shrink, _ = TensorParallel(plan=self.tpinfo).placements(model, degree)
        drops = {}
        names = [n for n, _ in model.named_modules() if n]
        for kind, pattern, _ in self.tpinfo:
            if kind in ("replic_drop", "parallel_drop"):
                drops.update({n: kind for n in names if name_matches(n, pattern)})
        return shard, shrink, drops

    def _patchers(self, model, entries) -> tuple[dict, str]:
        names = {n for n, _ in entries}
        given = dict(self.custom_patcher)
        unknown = sorted(set(given) - names)
        if unknown:
            raise ConfigError(
                "DeepSpeed3DParallelConfig.custom_patcher",
                unknown,
                f"names from the model's module list: {sorted(names)[:12]}",
            )
        if given:
            return given, f"{len(given)} custom patchers"
        builtin, family = builtin_patcher(model)
        return builtin, (f"built-in patchers for {family}" if family else "default patchers (no family recognised)")

    # -- apply ------------------------------------------------------------------------------
    def _checked(self, model, pc, sizes: dict) -> _Checked:
        """Everything read from the model and checked before any change (typed errors first)."""
        entries, dropped_head = check_model(model, module_list(model), self.tie_first)
        patchers, patch_note = self._patchers(model, entries)
        shard, shrink, drops = self._tp_placements(model, sizes["tensor"])
        block, n_blocks = block_class(entries)
        if n_blocks < sizes["pipeline"]:
            raise ConfigError(
                "parallel_mode pipeline size", sizes["pipeline"], f"at most the {n_blocks} {block} blocks of the model"
            )
        if not pc.distributed:
            raise RequirementError(
                self.name,
                "a process group (DeepSpeed's pipeline runs in a launched job)",
                "launch with `python -m composable_atorch launch --nproc N train.py`",
            )
        return _Checked(entries, dropped_head, patchers, patch_note, shard, shrink, drops, block, n_blocks)

    def _config(self, state: TrainState, ctx: ApplyContext, sizes: dict) -> dict:
        """DeepSpeed's engine config derived from the plan (micro-batches, precision, clipping) and ds_config."""
        per_rank = getattr(state.loader, "batch_size", None) if state.loader is not None else None
        user = read_ds_config(self.ds_config)
        clip = ctx.find("clip_grad")
        policy = PrecisionPolicy.of(ctx)
        config = engine_config(
            user,
            data_size=sizes["data"],
            stages=sizes["pipeline"],
            per_rank_batch=per_rank,
            clip=clip.max_norm if clip is not None else None,
            half=policy.name if policy.source == "half" else None,
        )
        if state.optim is None and "optimizer" not in user:
            raise ConfigError("optim", None, "a torch optimizer (optim_func), or an 'optimizer' section in ds_config")
        if state.optim is not None and "optimizer" in user:
            raise ConfigError(
                "ds_config['optimizer']",
                user["optimizer"],
                "absent: the plan passes your torch optimizer to the engine",
            )
        for name in ("bf16", "fp16"):
            if config.get(name, {}).get("enabled"):
                check_half_supported(name, self.name)
        return config

    def _builder(self, model, pc, sizes: dict, checked: _Checked, ctx: ApplyContext) -> StageBuilder:
        """What builds this rank's layers: recorded init args, tensor sharding, seeded dropout streams."""
        layout = pc.layout
        tp_rank = layout.coordinate(pc.rank, "tensor")
        coords = (layout.coordinate(pc.rank, "pipeline"), layout.coordinate(pc.rank, "data"))
        return StageBuilder(
            root=model,
            base_seed=self.base_seed,
            shard=checked.shard,
            shrink=checked.shrink,
            drops=checked.drops,
            tp_group=pc.mesh["tensor"].get_group() if sizes["tensor"] > 1 else None,
            tp_rank=tp_rank,
            tp_size=sizes["tensor"],
            rewrite=_layer_rewrite(ctx),
            replic_stream=RandomStream(_seed(self.base_seed, "replic", *coords)),
            parallel_stream=RandomStream(_seed(self.base_seed, "parallel", *coords, tp_rank)),
        )

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        pc = parallel_context(state, self.name)
        sizes = {n: pc.layout.size(n) for n in ("pipeline", "tensor", "data")}
        model = state.model
        checked = self._checked(model, pc, sizes)
        config = self._config(state, ctx, sizes)
        import deepspeed

        deepspeed.init_distributed(
            dist_backend="gloo" if ctx.env.device == "cpu" else "nccl", auto_mpi_discovery=False, verbose=False
        )
        builder = self._builder(model, pc, sizes, checked, ctx)
        helper = self.logit_helper or (
            vocab_parallel_logit_helper
            if any(k == "vocab" for k, _ in checked.shard.values())
            else default_logit_helper
        )
        specs = layer_specs(builder, checked.entries, checked.patchers, self.tie_first, helper)
        pipe = pipeline_module_class()(
            layers=specs,
            topology=topology(pc.layout),
            loss_fn=None,
            block_name=checked.block,
            checkpointable_layers=[checked.block],
        )
        optimizer = (
            None
            if state.optim is None
            else stage_optimizer(state.optim, state.param_names, pipe, checked.entries, self.tie_first)
        )
        engine, ds_optim, _, _ = deepspeed.initialize(
            model=pipe, optimizer=optimizer, config=config, dist_init_required=False
        )
        if self.batch_fn is not None:
            engine.set_batch_fn(self.batch_fn)
        exact_clipping(engine, builder.tp_rank)
        setattr(engine, NAME_PREFIX_ATTR, "module.")
        state.runner = Ds3dRunner(  # train_step drives it (it travels on the plan's optimizer)
            engine, config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
        )
        state.hooks.append(Ds3dHook(clips=bool(config.get("gradient_clipping"))))
        state.model, state.optim = engine, ds_optim
        state.param_names = {id(p): n for n, p in named_parameters(engine).items()}
        for line in engine_notes(pc, sizes, checked, specs, pipe, builder, config):
            state.note(self.name, line)
        return state


class _Checked(NamedTuple):
    """What ds_3d_parallel read from the model before any change."""

    entries: list
    dropped_head: Any
    patchers: dict
    patch_note: str
    shard: dict
    shrink: dict
    drops: dict
    block: str
    n_blocks: int


def ds_3d_parallel(config: DeepSpeed3DParallelConfig | None = None, **fields) -> DeepSpeed3DParallel:
    """``ds_3d_parallel(DeepSpeed3DParallelConfig(...))`` or ``ds_3d_parallel(tpinfo=..., ds_config=...)``."""
    if config is not None:
        if fields:
            raise ConfigError(
                "ds_3d_parallel", sorted(fields), "a DeepSpeed3DParallelConfig or keyword fields, not both"
            )
        return DeepSpeed3DParallel.from_seed(config)
    return DeepSpeed3DParallel(**fields)
