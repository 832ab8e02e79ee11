"""Pipeline parallelism on ``torch.distributed.pipelining``: ``pipeline_parallel``.

Each rank of the mesh's ``pipeline`` dimension keeps one stage: a contiguous run of the model's
blocks (cut at block boundaries, balanced by parameter count, or at the block indices given in
``split``), the first stage also the embeddings, the last also the final norm and the head. The
cutter knows the built-in GPT and HF causal LMs of the Llama family (rotary positions: a stage
reruns the model's own forward on ``inputs_embeds`` with only its layers). The
stage is a manual :class:`~torch.distributed.pipelining.PipelineStage` driven by a GPipe or 1F1B
schedule. Parameter names are kept (each rank holds a subset of them); the optimizer is rebuilt
over this stage's parameters.

A pipeline needs the loss inside its schedule, so the plain loop (``model(x)``) cannot train it:
the returned stage raises :class:`PipelineLoopError` when called outside
:func:`composable_atorch.train_step`, which trains every plan.

Gradients of a stage are averaged over the ``data`` dimension by this transform itself (it owns
``grad_sync``): its schedule runs several backward passes per step, which DDP's per-backward
all-reduce does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from composable_atorch.core.contract import Conflict, Contract, Implication, MinWorldSize, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import CompositionError, ConfigError, ParameterMappingError
from composable_atorch.runtime.optim import OptimizerHook
from composable_atorch.runtime.train_step import PIPELINE_ATTR
from composable_atorch.transforms.parallel.common import GRAD_SYNC, parallel_context

SCHEDULES = ("1F1B", "GPipe")


class PipelineLoopError(CompositionError, RuntimeError):
    """A pipeline stage called like a whole model (the plain loop would train one stage only)."""

    def __init__(self):
        super().__init__(
            "this model is one stage of a pipeline-parallel plan; calling it as model(x) would run one stage only. "
            "Fix: train with composable_atorch.train_step(model, optim, inputs, targets, loss_fn), which runs the "
            "pipeline schedule (it trains every plan, pipeline or not)."
        )


# ---------------------------------------------------------------------------------------------
# cutting the model
# ---------------------------------------------------------------------------------------------


def _is_builtin_gpt(model) -> bool:
    return all(hasattr(model, a) for a in ("tok", "pos", "blocks", "ln_f", "head")) and isinstance(model.blocks, nn.ModuleList)


def _hf_decoder(model):
    """The base model of an HF causal LM of the Llama family (embed_tokens, layers, norm; rotary positions)."""
    base = getattr(model, "base_model", None)
    if base is None or base is model or not hasattr(model, "lm_head"):
        return None
    if all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm")) and isinstance(base.layers, nn.ModuleList):
        return base
    return None


KNOWN_MODELS = "composable_atorch's GPT (tok, pos, blocks, ln_f, head) or an HF causal LM of the Llama family (model.embed_tokens, model.layers, model.norm, lm_head)"


def anatomy(model: nn.Module) -> tuple[list[nn.Module], int, int]:
    """(blocks, parameters outside blocks on the first stage, on the last stage); ConfigError if unknown."""
    if _is_builtin_gpt(model):
        return list(model.blocks), _numel(model.tok) + _numel(model.pos), _numel(model.ln_f) + _numel(model.head)
    base = _hf_decoder(model)
    if base is not None:
        return list(base.layers), _numel(base.embed_tokens), _numel(base.norm) + _numel(model.lm_head)
    raise ConfigError("pipeline_parallel model", type(model).__name__, f"a model the stage cutter knows: {KNOWN_MODELS}")


def _hf_stage(model: nn.Module, first: bool, last: bool, blocks: range) -> nn.Module:
    """The HF model itself cut to one stage, in place; names kept (layers keep their indices)."""
    import types

    base = _hf_decoder(model)
    if base.embed_tokens.weight is model.lm_head.weight and not (first and last):
        raise ConfigError("pipeline_parallel model", "tied input and output embeddings", "tie_word_embeddings=False (the first and last stages would train two copies)")
    layers = base.layers
    kept = nn.ModuleList()
    for i in blocks:
        kept._modules[str(i)] = layers[i]  # original indices: parameter names unchanged
    base.layers = kept
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = nn.Identity()
        model.lm_head = nn.Identity()
    forward_of_class = type(model).forward

    def forward(self, x):
        runner = getattr(self, PIPELINE_ATTR, None)
        if runner is not None and not runner.running:
            raise PipelineLoopError()
        out = forward_of_class(self, input_ids=x, use_cache=False) if first else forward_of_class(self, inputs_embeds=x, use_cache=False)
        return out.logits

    model.forward = types.MethodType(forward, model)
    return model


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def balanced_cuts(weights: list[int], stages: int, head: int = 0, tail: int = 0) -> tuple[int, ...]:
    """Start indices of stages 1.. over ``weights`` (blocks), minimising the largest stage.

    ``head`` / ``tail`` are the weights the first / last stage carry besides blocks.
    """
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(i, j, s):  # blocks i..j-1 as stage s
        return prefix[j] - prefix[i] + (head if s == 0 else 0) + (tail if s == stages - 1 else 0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                c = max(best[s - 1][i], cost(i, j, s - 1))
                if c < best[s][j]:
                    best[s][j], arg[s][j] = c, i
    cuts, j = [], n
    for s in range(stages, 0, -1):
        j = arg[s][j]
        cuts.append(j)
    return tuple(sorted(cuts)[1:])


class _GPTStage(nn.Module):
    """One stage of the built-in GPT, its submodules under their original names."""

    def __init__(self, model: nn.Module, first: bool, last: bool, blocks: range):
        super().__init__()
        if first:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if last:
            self.ln_f, self.head = model.ln_f, model.head
        self.first, self.last = first, last

    def forward(self, x):
        runner = getattr(self, PIPELINE_ATTR, None)
        if runner is not None and not runner.running:
            raise PipelineLoopError()
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.size(1), device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def broadcast_local(module: nn.Module, group) -> None:
    """Make every rank of ``group`` start from its first rank's parameters and buffers (DTensors: their shards)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t._local_tensor if hasattr(t, "_local_tensor") else t.data, group=group, group_src=0)


class DataGradSync(OptimizerHook):
    """Average a stage's gradients over the data dimension before the step."""

    def __init__(self, module: nn.Module, group, size: int):
        self.module, self.group, self.size = module, group, size

    def before_step(self, optimizer):
        from torch.distributed.tensor import DTensor

        for p in self.module.parameters():
            if p.grad is not None:
                g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(g, group=self.group)
                g.div_(self.size)


class PipelineRunner:
    """What train_step drives: this rank's PipelineStage and a schedule per loss function."""

    def __init__(self, stage, stages: int, index: int, microbatches: int, schedule: str, pp_group, data_group, data_size: int):
        self.stage, self.stages, self.index = stage, stages, index
        self.microbatches, self.schedule_name = microbatches, schedule
        self.pp_group, self.data_group, self.data_size = pp_group, data_group, data_size
        self.running = False
        self._schedules: dict[int, Any] = {}

    def _schedule(self, loss_fn):
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        key = id(loss_fn)
        if key not in self._schedules:
            cls = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[self.schedule_name]
            self._schedules[key] = (cls(self.stage, n_microbatches=self.microbatches, loss_fn=loss_fn), loss_fn)
        return self._schedules[key][0]

    def step(self, inputs, targets, loss_fn) -> float:
        """Forward and backward of one global (per data rank) batch; the mean loss on every rank."""
        if inputs.size(0) % self.microbatches:
            raise ConfigError("pipeline batch", inputs.size(0), f"a multiple of microbatches={self.microbatches}")
        schedule = self._schedule(loss_fn)
        losses: list[torch.Tensor] = []
        self.running = True
        try:
            if self.index == 0 and self.index == self.stages - 1:
                schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
            elif self.index == 0:
                schedule.step(inputs, return_outputs=False)
            elif self.index == self.stages - 1:
                schedule.step(target=targets, losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
        finally:
            self.running = False
        mean = torch.stack([v.detach().float() for v in losses]).mean() if losses else torch.zeros(())
        dist.broadcast(mean, group=self.pp_group, group_src=self.stages - 1)
        if self.data_size > 1:
            dist.all_reduce(mean, group=self.data_group)
            mean /= self.data_size
        return float(mean)


def _no_pipeline_dim(_mine, pm) -> bool:
    return not any(n == "pipeline" for n, _ in pm.groups)


@dataclass(frozen=True)
class PipelineParallel(Transform):
    """Cut the model into ``pipeline`` stages, one per rank, trained by a GPipe / 1F1B schedule.

    ``microbatches``: how many pieces each (per data rank) batch is cut into. ``split``: ``"auto"``
    (balance parameters over block boundaries) or the block indices where stages 1.. begin.
    """

    name = "pipeline_parallel"
    contract = Contract(
        stage=Stage.PIPELINE_SPLIT,
        owns=(GRAD_SYNC,),
        # ATorch drops distributed methods in one process (remove_distributed_method): skipped, with the reason
        requires=(MinWorldSize(minimum=2, on_unmet="skip"),),
        roles=("pipeline", "model_parallel"),
        renames=True,  # each rank keeps the parameters of its stage only (names unchanged)
        implies=(
            Implication(
                "parallel_mode",
                "pipeline stages live on the 'pipeline' dimension of parallel_mode's device mesh",
                config={"groups": (("pipeline", 2), ("data", 1))},
                satisfied_by=("process_groups",),
            ),
        ),
        conflicts=(
            Conflict(
                "parallel_mode",
                "parallel_mode has no 'pipeline' dimension to cut stages over",
                "add ('pipeline', n) to parallel_mode's groups, e.g. parallel_mode([('pipeline', 2), ('data', 1)])",
                when=_no_pipeline_dim,
            ),
        ),
    )

    microbatches: int = 2
    schedule: str = "1F1B"
    split: Any = "auto"

    def __post_init__(self):
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ConfigError("pipeline_parallel.microbatches", self.microbatches, "an integer >= 1")
        if self.schedule not in SCHEDULES:
            raise ConfigError("pipeline_parallel.schedule", self.schedule, ", ".join(map(repr, SCHEDULES)))
        if self.split != "auto":
            if isinstance(self.split, str) or not isinstance(self.split, list | tuple) or not all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in self.split):
                raise ConfigError("pipeline_parallel.split", self.split, "'auto' or increasing block indices > 0 where stages 1.. begin")
            if list(self.split) != sorted(set(self.split)):
                raise ConfigError("pipeline_parallel.split", self.split, "strictly increasing block indices")
            object.__setattr__(self, "split", tuple(self.split))

    def describe(self):
        split = "balanced by parameters" if self.split == "auto" else f"stages begin at blocks {list(self.split)}"
        return f"pipeline_parallel({self.schedule}, {self.microbatches} microbatches, {split})"

    def cuts(self, model: nn.Module, stages: int) -> tuple[int, ...]:
        blocks, head, tail = anatomy(model)
        n = len(blocks)
        if n < stages:
            raise ConfigError("pipeline_parallel", f"{n} blocks", f"at least as many blocks as pipeline stages ({stages})")
        if self.split == "auto":
            return balanced_cuts([_numel(b) for b in blocks], stages, head, tail)
        if len(self.split) != stages - 1 or self.split[-1] >= n:
            raise ConfigError("pipeline_parallel.split", list(self.split), f"{stages - 1} increasing block indices below {n}")
        return self.split

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        from torch.distributed.pipelining import PipelineStage

        pc = parallel_context(state, self.name)
        stages = pc.layout.size("pipeline")
        model = state.model
        cuts = self.cuts(model, stages)  # checks before any change
        if state.loader is not None and getattr(state.loader, "batch_size", None) and state.loader.batch_size % self.microbatches:
            raise ConfigError("loader per-rank batch", state.loader.batch_size, f"a multiple of pipeline_parallel.microbatches={self.microbatches}")
        if not pc.distributed or stages == 1:
            state.note(self.name, "pipeline size 1: model left whole")
            return state
        index = pc.layout.coordinate(pc.rank, "pipeline")
        blocks = anatomy(model)[0]
        sizes = [sum(_numel(blocks[i]) for i in range(lo, hi)) for lo, hi in zip((0, *cuts), (*cuts, len(blocks)), strict=True)]
        bounds = (0, *cuts, len(blocks))
        make = _GPTStage if _is_builtin_gpt(model) else _hf_stage
        stage_mod = make(model, index == 0, index == stages - 1, range(bounds[index], bounds[index + 1]))
        pp_group = pc.mesh["pipeline"].get_group()
        data_group = pc.data_group() if pc.data_size > 1 else None
        if data_group is not None:
            broadcast_local(stage_mod, data_group)
            state.hooks.append(DataGradSync(stage_mod, data_group, pc.data_size))
        pstage = PipelineStage(stage_mod, index, stages, torch.device(ctx.env.device), group=pp_group)
        runner = PipelineRunner(pstage, stages, index, self.microbatches, self.schedule, pp_group, data_group, pc.data_size)
        object.__setattr__(stage_mod, PIPELINE_ATTR, runner)  # a plain attribute, not a submodule
        if state.optim is not None:
            state.optim = _stage_optimizer(state.optim, state.param_names, stage_mod)
        state.model = stage_mod
        state.note(
            self.name,
            f"{stages} stages over blocks {[f'{bounds[s]}..{bounds[s + 1] - 1}' for s in range(stages)]} (block params {sizes}); "
            f"this rank is stage {index}; {self.schedule}, {self.microbatches} microbatches; train with composable_atorch.train_step"
            + (f"; stage gradients averaged over the data dim of {pc.data_size}" if data_group is not None else ""),
        )
        return state


def _stage_optimizer(optim: torch.optim.Optimizer, names: dict[int, str], stage: nn.Module) -> torch.optim.Optimizer:
    """The optimizer over this stage's parameters only, each param group and its hyperparameters kept."""
    import inspect

    own = {id(p) for p in stage.parameters()}
    held = {id(p) for g in optim.param_groups for p in g["params"]}
    missing = [n for n, p in stage.named_parameters() if id(p) not in held]
    if missing:
        raise ParameterMappingError("lose parameters of this pipeline stage the optimizer does not hold", missing)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [p for p in g["params"] if id(p) in own]} for g in optim.param_groups]
    groups = [g for g in groups if g["params"]]
    accepted = inspect.signature(type(optim).__init__).parameters
    new = type(optim)(groups, **{k: v for k, v in optim.defaults.items() if k in accepted})
    new.defaults = dict(optim.defaults)
    return new


def pipeline_parallel(*, microbatches: int = 2, schedule: str = "1F1B", split: Any = "auto") -> PipelineParallel:
    """``pipeline_parallel(microbatches=4, schedule="GPipe")``; train with :func:`composable_atorch.train_step`."""
    return PipelineParallel(microbatches=microbatches, schedule=schedule, split=split)

