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
import torch.distributed as dist
from torch import nn

from composable_atorch.core.contract import Conflict, Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError, ParameterMappingError
from composable_atorch.runtime.axes import DATA, PIPELINE
from composable_atorch.runtime.loader import first_length
from composable_atorch.runtime.sequence import probing
from composable_atorch.transforms.parallel.pipeline.check import check_stages, references
from composable_atorch.transforms.parallel.pipeline.cutter import call_whole, inputs_of, shared_sync, tied_sync
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

#: schedule name -> (torch class name, stage placement: "single" | "loop" | "v")
SCHEDULES = {
    "GPipe": ("ScheduleGPipe", "single"),
    "1F1B": ("Schedule1F1B", "single"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v"),
    "DualPipeV": ("ScheduleDualPipeV", "v"),
}
#: schedules that split the backward into input and weight passes (torch refuses compiled stages)
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def stage_ranks(schedule: str, pp: int, per_rank: int) -> dict[int, int]:
    """stage index -> pipeline rank, as torch's multi-stage schedules place them."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    style = SCHEDULES[schedule][1]
    return generate_stage_to_rank_mapping(pp, pp * per_rank, style="v" if style == "v" else "loop")


class PipelineRunner:
    """What train_step drives: this rank's PipelineStage(s) and a schedule per loss function."""

    def __init__(
        self,
        stages: list,
        n_stages: int,
        local: list[int],
        last_rank: int,
        microbatches: int,
        schedule: str,
        pp_group,
        loss_group: tuple,
        shared: list | None = None,
        an=None,
        main: str = "",
        guard: StageGuard | None = None,
    ):
        self.stages, self.n_stages, self.local, self.last_rank = stages, n_stages, local, last_rank
        #: parameters two of this rank's stages both use (a tied weight on a V's first and last stage):
        #: torch's schedule would divide their gradients by the microbatches once per stage; scaled here once
        self.shared = shared
        #: the cut's Anatomy (its ``carry``: the batch's inputs besides ``main`` the stages hand on)
        self.an, self.main = an, main
        self.microbatches, self.schedule_name = microbatches, schedule
        #: ``(group, size)`` the reported loss is averaged over: the parallel context's loss group (the data
        #: replicas and a sequence split installed before the cut: their ranks' losses are parts of one)
        self.pp_group, self.loss_group = pp_group, loss_group
        #: the stage's forward refuses outside the schedule once armed (the plain loop would run one stage)
        self.guard = guard or StageGuard()
        self.guard.armed = True
        self._schedules: dict[int, Any] = {}

    @property
    def running(self) -> bool:
        return self.guard.running

    def _schedule(self, loss_fn):
        from torch.distributed.pipelining import schedules

        key = id(loss_fn)
        if key not in self._schedules:
            cls_name, placement = SCHEDULES[self.schedule_name]
            cls = getattr(schedules, cls_name)
            stages = self.stages[0] if placement == "single" else self.stages
            scale = {"scale_grads": False} if self.shared else {}
            self._schedules[key] = (cls(stages, n_microbatches=self.microbatches, loss_fn=loss_fn, **scale), loss_fn)
        return self._schedules[key][0]

    def _inputs(self, inputs) -> tuple:
        """The first stage's positional inputs: the tensor, or a batch dict's main input and then the
        inputs the stages carry (an attention mask, token types: every rank reads their names from
        its own copy of the batch)."""
        if isinstance(inputs, dict):
            if self.an is None:
                raise ConfigError("pipeline inputs", sorted(inputs), "a tensor for the built-in GPT")
            main = self.main or next(iter(inputs))
            if main not in inputs:
                raise ConfigError("pipeline inputs", sorted(inputs), f"a dict holding the model's input {main!r}")
            self.an.carry[:] = [k for k in inputs if k != main and inputs[k] is not None]
            tensors = (inputs[main], *(inputs[k] for k in self.an.carry))
        else:
            if self.an is not None:
                self.an.carry[:] = []
            tensors = (inputs,)
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.size(0) % self.microbatches:
                raise ConfigError(
                    "pipeline batch",
                    tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__,
                    f"tensors whose batch size is a multiple of microbatches={self.microbatches}",
                )
        return tensors

    def step(self, inputs, targets, loss_fn) -> float:
        """Forward and backward of one global (per data rank) batch; the mean loss on every rank."""
        tensors = self._inputs(inputs)
        schedule = self._schedule(loss_fn)
        losses: list[torch.Tensor] = []
        first, last = 0 in self.local, self.n_stages - 1 in self.local
        args = tensors if first else ()
        kwargs = {"target": targets, "losses": losses} if last else {}
        self.guard.running = True
        try:
            schedule.step(*args, return_outputs=False, **kwargs)
        finally:
            self.guard.running = False
        for p in self.shared or ():
            if p.grad is not None:
                p.grad.div_(self.microbatches)
        mean = torch.stack([v.detach().float() for v in losses]).mean() if losses else torch.zeros(())
        dist.broadcast(mean, group=self.pp_group, group_src=self.last_rank)
        group, size = self.loss_group
        if size > 1:
            dist.all_reduce(mean, group=group)
            mean /= size
        return float(mean)


def _zero_bubble(mine, _compile) -> bool:
    return mine.schedule in ZERO_BUBBLE


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

    def apply(self, state: TrainState, ctx: ApplyContext, cut_plan=None) -> TrainState:
        from torch.distributed.pipelining import PipelineStage

        pc = parallel_context(state, self.name)
        pp = pc.layout.size("pipeline")
        model = state.model
        with probing():  # the probe forwards see the model as one process runs it (a sequence split stays out)
            an, cuts = cut_plan or self.cut_plan(model, pp, state.loader)  # checks before any change
        if (
            state.loader is not None
            and getattr(state.loader, "batch_size", None)
            and state.loader.batch_size % self.microbatches
        ):
            raise ConfigError(
                "loader per-rank batch",
                state.loader.batch_size,
                f"a multiple of pipeline_parallel.microbatches={self.microbatches}",
            )
        if not pc.distributed or pp == 1:
            state.note(self.name, "pipeline size 1: model left whole")
            if pc.distributed and pc.data_size > 1:  # this step owns gradient sync: the data ranks must agree
                group = pc.data_group()
                broadcast_local(model, group)
                state.hooks.append(DataGradSync(model, group, pc.data_size))
                state.note(self.name, f"gradients averaged over the data dim of {pc.data_size} before each step")
            return state
        index = pc.layout.coordinate(pc.rank, "pipeline")
        n_stages = pp * self.stages_per_rank
        placement = stage_ranks(self.schedule, pp, self.stages_per_rank)
        local = sorted(s for s, r in placement.items() if r == index)
        blocks = anatomy(model)[0] if an is None else an.blocks
        bounds = (0, *cuts, len(blocks))
        sizes = [sum(numel(blocks[i]) for i in range(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
        guard = StageGuard()
        kept, stage_mods = rank_modules(model, bounds, local, an, guard)
        pp_group = pc.mesh["pipeline"].get_group()
        with probing():  # every rank of the pipeline refuses when one stage does (none waits on it in training)
            checked = check_stages(an, stage_mods, local, bounds, pp_group)
        # a tied weight the last stage holds through its head only goes by the head's name there
        state.param_names.update({id(p): n for n, p in kept.named_parameters()})
        data_group = pc.data_group() if pc.data_size > 1 else None
        if data_group is not None:
            broadcast_local(kept, data_group)
            state.hooks.append(DataGradSync(kept, data_group, pc.data_size))
        tie = tied_sync(an, kept, local, n_stages, placement, pp_group)
        if tie is not None:  # a sum over the two stages; the data average above commutes with it
            state.hooks.append(tie)
        common = shared_sync(an, kept, pp_group)
        if common is not None:
            state.hooks.append(common)
        device = torch.device(ctx.env.device)
        pstages = [
            PipelineStage(m, s, n_stages, device, group=pp_group) for s, m in zip(local, stage_mods, strict=True)
        ]
        runner = PipelineRunner(
            pstages,
            n_stages,
            local,
            placement[n_stages - 1],
            self.microbatches,
            self.schedule,
            pp_group,
            pc.loss_group(),
            _shared(kept, stage_mods),
            an,
            inputs_of(model, an)[0] if an is not None else "",
            guard,
        )
        state.runner = runner  # train_step drives it (it travels on the plan's optimizer)
        if state.optim is not None:
            state.optim = _stage_optimizer(state.optim, state.param_names, kept)
        state.model = kept
        ranges = [f"{bounds[s]}..{bounds[s + 1] - 1}" for s in range(n_stages)]
        line = (
            f"{n_stages} stages over blocks {ranges} (block params {sizes}); this rank holds stage(s) {local}; "
            f"{self.schedule}, {self.microbatches} microbatches; train with composable_atorch.train_step"
        )
        if data_group is not None:
            line += f"; stage gradients averaged over the data dim of {pc.data_size}"
        if an is not None:
            line += f"; cut {type(model).__name__} at {an.path!r}, embeddings / head told apart by {an.source}"
            if an.tied:
                line += f"; tied {an.tied} kept equal (the first and last stage add their gradients)"
            if an.shared:
                line += f"; {an.shared} held by every stage (they feed every block), gradients summed over the pipeline"
            line += f"; {checked}"
        state.note(self.name, line)
        return state


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
