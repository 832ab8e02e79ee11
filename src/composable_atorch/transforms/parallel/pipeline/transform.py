"""Pipeline parallelism on ``torch.distributed.pipelining``: ``pipeline_parallel``.

The model is cut at block boundaries (balanced by parameter count, or where ``split`` says: block
indices or the blocks' qualified names) into ``pipeline size x stages_per_rank`` stages (see
:mod:`.stages`; any HF causal LM or model holding its blocks in a list, :mod:`.anatomy`), the
first also holding the embeddings, the last the final norm and the head (a weight tied between
them is held by both and kept equal). Each stage is a manual
:class:`~torch.distributed.pipelining.PipelineStage` driven by one of torch's schedules:

* one stage per rank: ``"GPipe"``, ``"1F1B"``;
* several ("virtual") stages per rank, on any model the cutter cuts, placed round-robin (rank r holds r, r+P, ...):
  ``"Interleaved1F1B"``, ``"LoopedBFS"``, and zero-bubble ``"InterleavedZeroBubble"`` (backward
  split into input and weight passes to fill the bubble);
* exactly two stages per rank in a V (rank r holds r and 2P-1-r, so rank 0 holds the first and
  the last): zero-bubble ``"ZBVZeroBubble"`` and ``"DualPipeV"``.

All of them ran on CPU / gloo in torch 2.13 and match one process (tests/parallel/test_pipeline_parallel.py).
The zero-bubble ones refuse compiled stages (torch cannot split a compiled backward into input
and weight passes), so they conflict with ``compile`` in the contract.

The inputs ``train_step`` gets are a tensor (token ids, pixels) or, for an HF model, a batch dict
(``{"input_ids": ..., "attention_mask": ...}``): its main input enters the first stage and the
rest (a padded batch's attention mask) travels with the activation from stage to stage. Before
training each stage this rank holds is compared, block by block, with the whole model on a probe
(:mod:`.check`, on probes shaped as training feeds it): what a stage would compute differently, or
cannot run, is a typed error on every rank, not a wrong result or a crash in training.

Parameter names are kept (each rank holds a subset of them); the optimizer is rebuilt over this
rank's parameters. A pipeline needs the loss inside its schedule, so the plain loop
(``model(x)``) cannot train it: the returned module raises :class:`PipelineLoopError` when
called outside :func:`composable_atorch.train_step`, which trains every plan.

Gradients of a stage are averaged over the ``data`` dimension by this transform itself (it owns
``grad_sync``): its schedule runs several backward passes per step, which DDP's per-backward
all-reduce does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from composable_atorch.core.contract import Conflict, Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError, ParameterMappingError
from composable_atorch.runtime.axes import DATA, PIPELINE
from composable_atorch.runtime.loader import first_length
from composable_atorch.runtime.mesh import StageGradients
from composable_atorch.runtime.sequence import probing
from composable_atorch.transforms.parallel.pipeline.check import check_stages, references
from composable_atorch.transforms.parallel.pipeline.cutter import call_whole, inputs_of, shared_sync, tied_sync
from composable_atorch.transforms.parallel.pipeline.runner import SCHEDULES, ZERO_BUBBLE, PipelineRunner, stage_ranks
from composable_atorch.transforms.parallel.pipeline.stages import (  # noqa: F401 - re-exported
    KNOWN_MODELS,
    PipelineLoopError,
    StageGuard,
    anatomy,
    anatomy_full,
    balanced_cuts,
    numel,
    rank_modules,
)
from composable_atorch.transforms.parallel.shared.sync import GRAD_SYNC, DataGradSync, broadcast_local, parallel_context


def _zero_bubble(mine, _compile) -> bool:
    return mine.schedule in ZERO_BUBBLE


def _fp16_scaler(_mine, amp) -> bool:
    return getattr(amp, "dtype", None) == "fp16" and getattr(amp, "enabled", True)


#: the schedule runs every backward itself, one per micro-batch: gradient accumulation IS its micro-batching
ACCUMULATE_CONFLICT = Conflict(
    "accumulate",
    "a pipeline schedule accumulates gradients over its own micro-batches and runs the backward itself; "
    "accumulate's optimizer would see a backward it did not scale",
    "drop accumulate and raise pipeline_parallel's microbatches (the global batch is split into them)",
)


@dataclass(frozen=True)
class PipelineParallel(Transform):
    """Cut the model into ``pipeline x stages_per_rank`` stages trained by one of torch's schedules.

    ``microbatches``: how many pieces each (per data rank) batch is cut into. ``split``: ``"auto"``
    (balance parameters over block boundaries), the block indices where stages 1.. begin, or
    those blocks' qualified names (``["model.layers.4"]``; a suffix such as ``"layers.4"`` will do).
    ``schedule``: one of :data:`SCHEDULES`. ``stages_per_rank``: virtual stages per rank (None:
    1 for GPipe / 1F1B, 2 for the interleaved and V schedules; the V ones need exactly 2).
    """

    name = "pipeline_parallel"
    contract = Contract(
        stage=Stage.PIPELINE_SPLIT,
        owns=(GRAD_SYNC,),
        roles=("pipeline", "model_parallel"),
        renames=True,  # each rank keeps the parameters of its stage only (names unchanged)
        axis=PIPELINE,
        uses=(DATA,),
        conflicts=(
            ACCUMULATE_CONFLICT,
            Conflict(
                "amp",
                "torch's pipeline schedule computes and backpropagates the loss inside its own steps, where "
                "fp16's grad scaler cannot scale it (the first step stopped on an unscaled backward)",
                "use amp('bf16') (no scaler: fp32's range), or drop pipeline_parallel",
                when=_fp16_scaler,
            ),
            Conflict(
                "compile",
                "torch's zero-bubble schedules split each backward into input and weight passes, "
                "which a compiled stage cannot do (torch.distributed.pipelining refuses compiled stages for them)",
                "drop compile, or use schedule='Interleaved1F1B' / '1F1B'",
                when=_zero_bubble,
            ),
        ),
    )

    microbatches: int = 2
    schedule: str = "1F1B"
    split: Any = "auto"
    stages_per_rank: int | None = None

    def __post_init__(self):
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ConfigError("pipeline_parallel.microbatches", self.microbatches, "an integer >= 1")
        if self.schedule not in SCHEDULES:
            raise ConfigError("pipeline_parallel.schedule", self.schedule, ", ".join(map(repr, SCHEDULES)))
        placement = SCHEDULES[self.schedule][1]
        k = self.stages_per_rank
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(
                "pipeline_parallel.stages_per_rank", k, "an integer >= 1, or None for the schedule's default"
            )
        if placement == "single" and k not in (None, 1):
            raise ConfigError(
                "pipeline_parallel.stages_per_rank",
                k,
                f"1 for {self.schedule} (one stage per rank); use schedule='Interleaved1F1B' for virtual stages",
            )
        if placement == "v" and k not in (None, 2):
            raise ConfigError(
                "pipeline_parallel.stages_per_rank",
                k,
                f"2 for {self.schedule}: torch's V schedules place exactly two stages per rank",
            )
        if k is None:
            object.__setattr__(self, "stages_per_rank", 1 if placement == "single" else 2)
        if self.split != "auto":
            items = list(self.split) if isinstance(self.split, list | tuple) else None
            ints = items is not None and all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in items)
            paths = items is not None and all(isinstance(i, str) and i for i in items)
            if not items or not (ints or paths):
                raise ConfigError(
                    "pipeline_parallel.split",
                    self.split,
                    "'auto', increasing block indices > 0 where stages 1.. begin, or the qualified names of those "
                    "blocks (e.g. ['model.layers.4'])",
                )
            if ints and items != sorted(set(items)):
                raise ConfigError("pipeline_parallel.split", self.split, "strictly increasing block indices")
            object.__setattr__(self, "split", tuple(items))

    def describe(self):
        split = "balanced by parameters" if self.split == "auto" else f"stages begin at blocks {list(self.split)}"
        per = f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
        return f"pipeline_parallel({self.schedule}{per}, {self.microbatches} microbatches, {split})"

    def _paths(self) -> tuple[str, ...]:
        return tuple(self.split) if self.split != "auto" and isinstance(self.split[0], str) else ()

    def cuts(self, model: nn.Module, pp: int) -> tuple[int, ...]:
        """Start blocks of stages 1.. for ``pp`` ranks (``pp x stages_per_rank`` stages); typed errors first."""
        return self.cut_plan(model, pp)[1]

    def cut_plan(self, model: nn.Module, pp: int, loader=None):
        """(the generic cutter's Anatomy or None for the built-in GPT, start blocks of stages 1..).

        Read it before tensor parallelism shards the weights (mixed_parallel does): the anatomy's
        probe forward runs on plain weights only. The stage check's probes are as long as the
        ``loader``'s sequences where its dataset tells it."""
        stages = pp * self.stages_per_rank
        an = anatomy_full(model, self._paths())
        if an is None:
            blocks, head, tail = anatomy(model)
        else:
            blocks, (head, tail) = an.blocks, an.weights(model)
        n = len(blocks)
        if n < stages:
            raise ConfigError(
                "pipeline_parallel",
                f"{n} blocks",
                f"at least as many blocks as pipeline stages ({pp} ranks x {self.stages_per_rank} per rank = {stages})",
            )
        if self.schedule == "1F1B" and self.microbatches < pp:
            raise ConfigError(
                "pipeline_parallel.microbatches",
                self.microbatches,
                f"at least the pipeline size {pp} for 1F1B (torch's Schedule1F1B)",
            )
        if self.schedule == "DualPipeV" and self.microbatches < stages:
            raise ConfigError(
                "pipeline_parallel.microbatches",
                self.microbatches,
                f"at least the number of stages {stages} for DualPipeV",
            )
        rounds = max(1, self.microbatches // pp)
        if SCHEDULES[self.schedule][1] == "loop" and self.schedule != "LoopedBFS" and self.microbatches % rounds:
            raise ConfigError(
                "pipeline_parallel.microbatches",
                self.microbatches,
                f"a multiple of max(1, microbatches // pipeline size) = {rounds} for {self.schedule}",
            )
        if an is not None and an.references is None:
            length = first_length(loader) if loader is not None else None
            an.references = references(model, an, lambda m, x, **kw: call_whole(m, an, x, **kw), length)
        if self.split == "auto":
            return an, balanced_cuts([numel(b) for b in blocks], stages, head, tail)
        split = self.split
        if self._paths():
            split = tuple(int(p.rpartition(".")[2]) for p in split)
        if len(split) != stages - 1 or split[-1] >= n or list(split) != sorted(set(split)) or split[0] < 1:
            raise ConfigError(
                "pipeline_parallel.split",
                list(self.split),
                f"{stages - 1} increasing blocks after the first, below {n}",
            )
        return an, split

    def _check_batch(self, loader) -> None:
        if loader is not None and getattr(loader, "batch_size", None) and loader.batch_size % self.microbatches:
            raise ConfigError(
                "loader per-rank batch",
                loader.batch_size,
                f"a multiple of pipeline_parallel.microbatches={self.microbatches}",
            )

    def _cut(self, model: nn.Module, pc, an, cuts) -> Cut:
        """This rank's stages of the model (cut in place where the generic cutter cuts it)."""
        pp = pc.layout.size("pipeline")
        index = pc.layout.coordinate(pc.rank, "pipeline")
        placement = stage_ranks(self.schedule, pp, self.stages_per_rank)
        local = sorted(s for s, r in placement.items() if r == index)
        blocks = anatomy(model)[0] if an is None else an.blocks
        bounds = (0, *cuts, len(blocks))
        sizes = [sum(numel(blocks[i]) for i in range(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
        guard = StageGuard()
        kept, stage_mods = rank_modules(model, bounds, local, an, guard)
        return Cut(pp * self.stages_per_rank, placement, local, bounds, sizes, kept, stage_mods, guard)

    def _runner(self, ctx: ApplyContext, pc, model: nn.Module, an, cut: Cut, pp_group) -> PipelineRunner:
        from torch.distributed.pipelining import PipelineStage

        device = torch.device(ctx.env.device)
        n = cut.n_stages
        stages = [
            PipelineStage(m, s, n, device, group=pp_group) for s, m in zip(cut.local, cut.stage_mods, strict=True)
        ]
        return PipelineRunner(
            stages,
            n,
            cut.local,
            cut.placement[n - 1],
            self.microbatches,
            self.schedule,
            pp_group,
            pc.loss_group(),
            _shared(cut.kept, cut.stage_mods),
            an,
            inputs_of(model, an)[0] if an is not None else "",
            cut.guard,
        )

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        pc = parallel_context(state, self.name)
        pp = pc.layout.size("pipeline")
        model = state.model
        with probing():  # the probe forwards see the model as one process runs it (a sequence split stays out)
            an, cuts = self.cut_plan(model, pp, state.loader)  # checks before any change
        self._check_batch(state.loader)
        if not pc.distributed or pp == 1:
            return _whole(state, pc, self.name)
        cut = self._cut(model, pc, an, cuts)
        pp_group = pc.mesh["pipeline"].get_group()
        with probing():  # every rank of the pipeline refuses when one stage does (none waits on it in training)
            checked = check_stages(an, cut.stage_mods, cut.local, cut.bounds, pp_group)
        # a tied weight the last stage holds through its head only goes by the head's name there
        state.param_names.update({id(p): n for n, p in cut.kept.named_parameters()})
        pc.stage_grads = _sync(state, pc, an, cut, pp_group)
        state.runner = self._runner(ctx, pc, model, an, cut, pp_group)  # train_step drives it (on the plan's optim)
        if state.optim is not None:
            state.optim = _stage_optimizer(state.optim, state.param_names, cut.kept)
        state.model = cut.kept
        state.note(self.name, self._line(model, pc, an, cut, checked))
        return state

    def _line(self, model: nn.Module, pc, an, cut: Cut, checked: str) -> str:
        """explain()'s line for the cut: the stages, this rank's, the schedule and how gradients are kept equal."""
        ranges = [f"{cut.bounds[s]}..{cut.bounds[s + 1] - 1}" for s in range(cut.n_stages)]
        line = (
            f"{cut.n_stages} stages over blocks {ranges} (block params {cut.sizes}); this rank holds stage(s) "
            f"{cut.local}; {self.schedule}, {self.microbatches} microbatches; train with composable_atorch.train_step"
        )
        if pc.data_size > 1:
            line += f"; stage gradients averaged over the data dim of {pc.data_size}"
        if an is not None:
            line += f"; cut {type(model).__name__} at {an.path!r}, embeddings / head told apart by {an.source}"
            if an.tied:
                line += f"; tied {an.tied} kept equal (the first and last stage add their gradients)"
            if an.shared:
                line += f"; {an.shared} held by every stage (they feed every block), gradients summed over the pipeline"
            line += f"; {checked}"
        return line


@dataclass(frozen=True)
class Cut:
    """This rank's part of the cut: the stage count and placement, its stage indices, block bounds and sizes,
    the module it keeps, one module per local stage, and the guard its runner arms."""

    n_stages: int
    placement: dict[int, int]
    local: list[int]
    bounds: tuple[int, ...]
    sizes: list[int]
    kept: nn.Module
    stage_mods: list[nn.Module]
    guard: StageGuard


def _whole(state: TrainState, pc, who: str) -> TrainState:
    """Pipeline size 1: the model is left whole; this step owns gradient sync, so the data ranks must agree."""
    state.note(who, "pipeline size 1: model left whole")
    if pc.distributed and pc.data_size > 1:
        group = pc.data_group()
        broadcast_local(state.model, group)
        state.hooks.append(DataGradSync(state.model, group, pc.data_size))
        state.note(who, f"gradients averaged over the data dim of {pc.data_size} before each step")
    return state


def _sync(state: TrainState, pc, an, cut: Cut, pp_group) -> StageGradients:
    """The stage's gradient hooks: averaged over the data replicas, a tied weight summed over its two stages,
    parameters every stage holds summed over the pipeline. Returns how the gradients are split over the
    pipeline (clip_grad's norm and the inf/nan checks reduce over it, each such parameter counted once)."""
    if pc.data_size > 1:
        group = pc.data_group()
        broadcast_local(cut.kept, group)
        state.hooks.append(DataGradSync(cut.kept, group, pc.data_size))
    held: dict[int, int] = {}
    tie = tied_sync(an, cut.kept, cut.local, cut.n_stages, cut.placement, pp_group)
    if tie is not None:  # a sum over the two stages; the data average above commutes with it
        state.hooks.append(tie)
        held.update((id(p), 2) for p in tie.params)
    common = shared_sync(an, cut.kept, pp_group)
    if common is not None:
        state.hooks.append(common)
        held.update((id(p), pc.layout.size("pipeline")) for p in common.params)
    return StageGradients(pp_group, held)


def _shared(kept: nn.Module, stage_mods: list[nn.Module]) -> list | None:
    """This rank's parameters (each once) when two of its stages use one of them; else None."""
    count = sum(len({id(p) for p in m.parameters()}) for m in stage_mods)
    unique = list(kept.parameters())
    return unique if count > len(unique) else None


def _stage_optimizer(optim: torch.optim.Optimizer, names: dict[int, str], stage: nn.Module) -> torch.optim.Optimizer:
    """The optimizer over this stage's parameters only, each param group and its hyperparameters kept."""
    import inspect

    own = {id(p) for p in stage.parameters()}
    held = {id(p) for g in optim.param_groups for p in g["params"]}
    missing = [n for n, p in stage.named_parameters() if id(p) not in held and p.requires_grad]
    if missing:
        raise ParameterMappingError("lose parameters of this pipeline stage the optimizer does not hold", missing)
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [p for p in g["params"] if id(p) in own]}
        for g in optim.param_groups
    ]
    groups = [g for g in groups if g["params"]]
    accepted = inspect.signature(type(optim).__init__).parameters
    new = type(optim)(groups, **{k: v for k, v in optim.defaults.items() if k in accepted})
    new.defaults = dict(optim.defaults)
    return new


def pipeline_parallel(
    *, microbatches: int = 2, schedule: str = "1F1B", split: Any = "auto", stages_per_rank: int | None = None
) -> PipelineParallel:
    """``pipeline_parallel(microbatches=4, schedule="Interleaved1F1B", stages_per_rank=2)``;
    train with :func:`composable_atorch.train_step`."""
    return PipelineParallel(microbatches=microbatches, schedule=schedule, split=split, stages_per_rank=stages_per_rank)
