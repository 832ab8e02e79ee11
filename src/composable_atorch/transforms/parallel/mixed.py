"""``mixed_parallel``: ATorch's tensor x pipeline x data parallelism in one step.

The degrees come from ``parallel_mode`` (``[("tensor", 2), ("pipeline", 2), ("data", 2)]``), as in
ATorch, or from ``mixed_parallel(tensor=2, pipeline=2)`` itself (the data size absorbs the rest of
the world; the step then lays out the mesh and splits the loader itself, which is how the auto
search proposes parallel degrees: one candidate per factorization of the world size).
Either way:
tensor parallelism where the tensor size is > 1 (:class:`TensorParallel` with ``tp_plan``),
pipeline stages where the pipeline size is > 1 (:class:`PipelineParallel`), and gradients
averaged over the data dimension (this step owns gradient sync, as ATorch's mixed_parallel does).
Use ``tensor_parallel | pipeline_parallel | fsdp`` to choose each engine yourself.

With a sequence split (``context_parallel()`` over a ``("context", n)`` dimension, or Ulysses'
``sequence_parallel()`` over ``("sequence", n)``) this step runs it between its tensor and pipeline
steps, where it runs composed with ``tensor_parallel | pipeline_parallel``: attention routed on
the tensor-sharded model, stages cut from the split model. A split dimension without its
transform is refused (each rank of it would train the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from composable_atorch.core.contract import Conflict, Contract, Order, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError, RequirementError
from composable_atorch.runtime.layout import ParallelContext, make_context, plan_layout, refit_hint
from composable_atorch.runtime.loader import check_global_batch, split_over_data
from composable_atorch.runtime.optim import rebuild_optimizer
from composable_atorch.runtime.train_step import mark_loss_group
from composable_atorch.transforms.parallel.data.common import GRAD_SYNC, DataGradSync, broadcast_local, parallel_context
from composable_atorch.transforms.parallel.pipeline.transform import ACCUMULATE_CONFLICT, PipelineParallel
from composable_atorch.transforms.parallel.tensor.transform import TensorParallel, normalize_plan

#: the sequence splits this step applies between its tensor and pipeline steps: transform name -> mesh dimension
SPLITS = {"context_parallel": "context", "sequence_parallel": "sequence"}

MIXED_APPLIES = "mixed_parallel applies it itself over parallel_mode's dimensions"


def factorizations(world: int) -> list[tuple[int, int, int]]:
    """Every ``(tensor, pipeline, data)`` with ``tensor * pipeline * data == world``."""
    return [
        (t, p, world // (t * p))
        for t in range(1, world + 1)
        if world % t == 0
        for p in range(1, world // t + 1)
        if (world // t) % p == 0
    ]


def _degrees_differ(mine, pm) -> bool:
    if mine.tensor is None and mine.pipeline is None:
        return False
    groups = dict(pm.groups)
    return any(
        d is not None and groups.get(n, 1) != d for n, d in (("tensor", mine.tensor), ("pipeline", mine.pipeline))
    )


def _has_pipeline(mine, _accumulate) -> bool:
    """With a pipeline degree given here (the search's candidates give it).

    One read from parallel_mode is refused when applied.
    """
    return (mine.pipeline or 1) > 1


@dataclass(frozen=True)
class MixedParallel(Transform):
    """Tensor x pipeline x data parallelism with degrees from ``parallel_mode``; train with ``train_step``."""

    name = "mixed_parallel"
    contract = Contract(
        stage=Stage.TENSOR_PARALLEL,
        owns=(GRAD_SYNC,),
        roles=("model_parallel", "process_groups"),
        reads=(*SPLITS, "pipeline_parallel", "checkpoint"),
        orders=tuple(
            Order(split, "mixed_parallel applies the sequence split between its tensor and pipeline steps", after=False)
            for split in SPLITS
        ),
        renames=True,  # with a pipeline each rank keeps its stage's parameters only
        conflicts=(
            Conflict(
                "parallel_mode",
                "mixed_parallel's degrees differ from parallel_mode's groups",
                "give the degrees once: in parallel_mode's groups, or as mixed_parallel(tensor=..., pipeline=...)",
                when=_degrees_differ,
            ),
            Conflict(
                "tensor_parallel",
                MIXED_APPLIES,
                "drop tensor_parallel (or drop mixed_parallel and compose the engines yourself)",
            ),
            Conflict(
                "pipeline_parallel",
                MIXED_APPLIES,
                "drop pipeline_parallel (or drop mixed_parallel and compose the engines yourself)",
            ),
            next(
                c for c in PipelineParallel.contract.conflicts if c.other == "compile"
            ),  # zero-bubble schedules vs compile
            replace(ACCUMULATE_CONFLICT, when=_has_pipeline),
        ),
    )

    tp_plan: Any = "auto"
    microbatches: int = 2
    schedule: str = "1F1B"
    #: virtual pipeline stages per rank (None: the schedule's default, see pipeline_parallel)
    stages_per_rank: int | None = None
    #: degrees, or None to read them from parallel_mode
    tensor: int | None = None
    pipeline: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "tp_plan", normalize_plan(self.tp_plan))
        pp = PipelineParallel(
            microbatches=self.microbatches, schedule=self.schedule, stages_per_rank=self.stages_per_rank
        )  # validates them
        object.__setattr__(self, "stages_per_rank", pp.stages_per_rank)
        for field in ("tensor", "pipeline"):
            v = getattr(self, field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(
                    f"mixed_parallel.{field}", v, "an integer >= 1, or None to read it from parallel_mode"
                )

    @classmethod
    def candidates(cls, search):
        """One per factorization of the world into tensor x pipeline x data with some model
        parallelism; with a pipeline, one per micro-batch count in (stages, 2 x stages) that
        divides the per-data-rank batch (fewer micro-batches than stages leaves stages idle; more
        shrinks the bubble at more per-micro-batch overhead: the search measures which wins).

        A factorization whose data size does not divide the global batch is left out (the loader
        split would refuse it). The trial worker trains every plan through ``train_step``, so
        pipeline plans are measured like any other. On paper (``search.on_paper``): :meth:`_on_paper`.
        """
        world, batch = search.env.world_size, search.batch_size
        if search.on_paper:
            return cls._on_paper(search)
        out = []
        for t, p, d in factorizations(world):
            if (t == 1 and p == 1) or batch % d:
                continue
            if p == 1:
                out.append(cls(tensor=t, pipeline=1))
                continue
            out.extend(cls(tensor=t, pipeline=p, microbatches=m) for m in (p, 2 * p) if (batch // d) % m == 0)
        return tuple(out)

    @classmethod
    def _on_paper(cls, search):
        """The pipeline options priced on paper: every pipeline degree with a tensor degree up to one node's
        devices, (stages, 2 x stages) micro-batches, and each of torch's schedules that accepts them (the
        bubble differs per schedule; pricing one costs an estimate, not a run). Tensor degrees without a
        pipeline are tensor_parallel's ``tensor x data`` layouts there, which a sharded engine composes with."""
        from composable_atorch.transforms.parallel.pipeline.transform import SCHEDULES

        env, batch, out = search.env, search.batch_size, []
        for t, p, d in factorizations(env.world_size):
            if p == 1 or t > env.processes_per_node or batch % d:
                continue
            for m in (p, 2 * p):
                if (batch // d) % m:
                    continue
                for schedule in SCHEDULES:
                    try:
                        out.append(cls(tensor=t, pipeline=p, microbatches=m, schedule=schedule))
                    except ConfigError:  # a schedule that refuses this micro-batch count
                        continue
        return tuple(out)

    def resolve(self, env):
        if self.tensor is not None or self.pipeline is not None:
            fixed = (self.tensor or 1) * (self.pipeline or 1)
            if env.world_size % fixed:
                others = (("tensor", self.tensor or 1), ("pipeline", self.pipeline or 1))
                raise ConfigError(
                    "mixed_parallel degrees",
                    f"tensor {self.tensor} x pipeline {self.pipeline}",
                    f"a product dividing the world size {env.world_size}; {refit_hint(others, env.world_size)}",
                )
        return self, None

    def describe(self):
        if self.tensor is None and self.pipeline is None:
            where = "tensor x pipeline x data from parallel_mode"
        else:
            where = f"tensor {self.tensor or 1} x pipeline {self.pipeline or 1} x data (the rest)"
        return f"mixed_parallel({where}; {self.schedule}, {self.microbatches} microbatches)"

    def _context(self, state: TrainState, ctx: ApplyContext) -> ParallelContext:
        if isinstance(state.parallel, ParallelContext):
            return parallel_context(state, self.name)
        if self.tensor is None and self.pipeline is None:
            raise RequirementError(
                self.name,
                "parallel degrees",
                "compose it with parallel_mode([('tensor', t), ('pipeline', p), ('data', d)]) or give "
                "mixed_parallel(tensor=t, pipeline=p)",
            )
        groups = [("tensor", self.tensor or 1), ("pipeline", self.pipeline or 1), ("data", 1)]
        layout = plan_layout(groups, ctx.env.world_size)
        if state.loader is not None and layout.batch_split > 1:
            check_global_batch(state.loader, layout)  # before the mesh's groups exist
        pc = make_context(layout, ctx.env.device)
        state.parallel = pc
        if state.loader is not None and (pc.data_size > 1 or pc.distributed):
            state.loader = split_over_data(state.loader, layout, pc.rank, distributed=pc.distributed)[0]
        state.note(
            self.name,
            f"layout {pc.layout.describe()}; device mesh {pc.layout.mesh_dim_names}; loader split over the data dim of "
            f"{pc.data_size}",
        )
        return pc

    def check(self, model, degree: int = 1) -> list[str]:
        """tensor_parallel's planning check at this step's tensor degree (the search rules out a
        candidate whose model cannot be sharded before it costs a trial)."""
        degree = self.tensor or degree
        return TensorParallel(plan=self.tp_plan).check(model, degree) if degree > 1 else []

    def _split(self, pc: ParallelContext, ctx: ApplyContext):
        """The plan's sequence split (None without one); a split dimension without its transform is refused."""
        for name, dim in SPLITS.items():
            split = ctx.find(name)
            if split is None and pc.layout.size(dim) > 1:
                raise ConfigError(
                    f"mixed_parallel: parallel_mode's {dim!r} dimension",
                    pc.layout.size(dim),
                    f"add {name}() to the plan (mixed_parallel applies it between its tensor and pipeline steps), or "
                    f"drop the {dim!r} dimension: without it every rank of that dimension trains the same tokens",
                )
            if split is not None:
                return split
        return None

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        pc = self._context(state, ctx)
        sizes = {n: pc.layout.size(n) for n in ("tensor", "pipeline", "data")}
        split = self._split(pc, ctx)
        tp = TensorParallel(plan=self.tp_plan)
        pp = PipelineParallel(
            microbatches=self.microbatches, schedule=self.schedule, stages_per_rank=self.stages_per_rank
        )
        # every check before any change
        if sizes["tensor"] > 1:
            tp.placements(state.model, sizes["tensor"])
        # with a split, the stages are planned on the split model (its probe reference then builds the masks
        # the split model builds), as pipeline_parallel composed after the split does
        cut_plan = None
        if sizes["pipeline"] > 1 and split is None:
            cut_plan = pp.cut_plan(state.model, sizes["pipeline"], state.loader)
        if sizes["tensor"] > 1:
            state = tp.apply(state, ctx)
            if state.optim is not None:  # over the DTensor parameters, before the pipeline picks its stage's
                state.optim = rebuild_optimizer(state.optim, state.param_names, state.model)
        if sizes["pipeline"] == 1 and pc.distributed and pc.data_size > 1:
            group = pc.data_group()
            broadcast_local(state.model, group)
            state.hooks.append(DataGradSync(state.model, group, pc.data_size))
            mark_loss_group(state.model, group, pc.data_size)  # before the split, which widens it to data x split
            state.note(self.name, f"gradients averaged over the data dim of {pc.data_size} before each step")
        if split is not None:  # on the tensor-sharded model, before the stages are cut (as composed separately)
            state = split.apply(state, ctx)
        if sizes["pipeline"] > 1:
            state = pp.apply(state, ctx, cut_plan)  # averages its stage's gradients over the data dim
        state.note(self.name, " x ".join(f"{n} {s}" for n, s in sizes.items()))
        return state


def mixed_parallel(
    tp_plan: Any = "auto",
    *,
    microbatches: int = 2,
    schedule: str = "1F1B",
    stages_per_rank: int | None = None,
    tensor: int | None = None,
    pipeline: int | None = None,
) -> MixedParallel:
    """Mixed tensor x pipeline x data parallelism.

    ``mixed_parallel()`` with ``parallel_mode([("tensor", 2), ("pipeline", 2), ("data", 2)])``,
    or ``mixed_parallel(tensor=2, pipeline=2)``.
    """
    return MixedParallel(
        tp_plan=tp_plan,
        microbatches=microbatches,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        tensor=tensor,
        pipeline=pipeline,
    )
