"""``mixed_parallel``: ATorch's tensor x pipeline x data parallelism, as the steps it stands for.

The degrees come from ``parallel_mode`` (``[("tensor", 2), ("pipeline", 2), ("data", 2)]``), as in
ATorch, or from ``mixed_parallel(tensor=2, pipeline=2)`` itself (the data size absorbs the rest of
the world: the auto search proposes parallel degrees this way, one candidate per factorization of
the world size). compose() expands it (:meth:`MixedParallel.expand`) into

    parallel_mode(...) | tensor_parallel(tp_plan) | [the split] | pipeline_parallel(...) or ddp()

tensor parallelism where the tensor size is > 1, pipeline stages where the pipeline size is > 1
(which average each stage's gradients over the data dimension), otherwise ddp (for tensor-parallel
DTensor parameters: averaged over the data group before each step), as ATorch's mixed_parallel owns
gradient sync. Each part is then checked and ordered by its own contract, as if written out:
``tensor_parallel | pipeline_parallel | fsdp`` chooses each engine yourself.

With a sequence split (``context_parallel()`` over a ``("context", n)`` dimension, or Ulysses'
``sequence_parallel()`` over ``("sequence", n)``) the split's contract orders it after the tensor
step and before the pipeline's (attention routed on the tensor-sharded model, stages cut from the
split model). A split dimension without its transform is refused at compose time (each rank of it
would train the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from composable_atorch.core.contract import Conflict, Contract, Stage
from composable_atorch.core.registry import axis_owners
from composable_atorch.core.transform import Transform
from composable_atorch.errors import CompositionError, ConfigError, RequirementError
from composable_atorch.runtime.axes import DATA, PIPELINE, TENSOR
from composable_atorch.runtime.layout import refit_hint
from composable_atorch.transforms.parallel import sequence  # noqa: F401 - registers the sequence splits
from composable_atorch.transforms.parallel.data import Ddp, ParallelMode
from composable_atorch.transforms.parallel.pipeline.transform import ACCUMULATE_CONFLICT, PipelineParallel
from composable_atorch.transforms.parallel.shared.sync import GRAD_SYNC
from composable_atorch.transforms.parallel.tensor.transform import ZERO1_CONFLICT, TensorParallel, normalize_plan

MIXED_APPLIES = "mixed_parallel expands into it itself, over parallel_mode's dimensions"


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
    """With a pipeline degree given here (the search's candidates give it); one read from parallel_mode is
    refused by the pipeline part's own contract."""
    return (mine.pipeline or 1) > 1


def _has_tensor(mine, _zero1) -> bool:
    """With a tensor degree given here; one read from parallel_mode is refused by the tensor part's contract."""
    return (mine.tensor or 1) > 1


@dataclass(frozen=True)
class MixedParallel(Transform):
    """Tensor x pipeline x data parallelism with degrees from ``parallel_mode``; train with ``train_step``."""

    name = "mixed_parallel"
    expands = True
    contract = Contract(
        stage=Stage.TENSOR_PARALLEL,
        owns=(GRAD_SYNC,),
        roles=("model_parallel", "process_groups"),
        uses=(TENSOR, PIPELINE, DATA),
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
            # its pipeline part's, declared here too: the search groups contending kinds by their contracts
            next(c for c in PipelineParallel.contract.conflicts if c.other == "compile"),  # zero-bubble vs compile
            replace(ACCUMULATE_CONFLICT, when=_has_pipeline),
            replace(ZERO1_CONFLICT, when=_has_tensor),
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

    def _mode(self, others) -> tuple[Any, bool]:
        """``(parallel_mode, whether it is one of the parts)``: the request's, the one this step's degrees lay
        out (the data size absorbs the rest), or the one another step implies (read for its layout; the
        implication adds it, with its reason)."""
        pm = next((t for t in others if t.name == "parallel_mode"), None)
        if pm is not None:
            return pm, True
        if self.tensor is not None or self.pipeline is not None:
            groups = (("tensor", self.tensor or 1), ("pipeline", self.pipeline or 1), ("data", 1))
            return ParallelMode(groups=groups), True
        for t in sorted(others, key=lambda t: t.sort_key()):
            for imp in t.contract.implies:
                if imp.name == "parallel_mode":
                    return ParallelMode(**imp.config), False
        raise RequirementError(
            self.name,
            "parallel degrees",
            "compose it with parallel_mode([('tensor', t), ('pipeline', p), ('data', d)]) or give "
            "mixed_parallel(tensor=t, pipeline=p)",
        )

    def _split(self, layout, others) -> tuple:
        """The request's sequence split, when the layout has its dimension; a split dimension without its
        transform is refused (every rank of it would train the same tokens)."""
        out = []
        for name, dim in axis_owners(split=True).items():
            split = next((t for t in others if t.name == name), None)
            if split is None and layout.size(dim) > 1:
                raise ConfigError(
                    f"mixed_parallel: parallel_mode's {dim!r} dimension",
                    layout.size(dim),
                    f"add {name}() to the plan (it runs between the tensor and pipeline steps), or drop the {dim!r} "
                    "dimension: without it every rank of that dimension trains the same tokens",
                )
            if split is not None:
                out.append(split)
        return tuple(out)

    def expand(self, env, others):
        """``parallel_mode | tensor_parallel | [the split] | pipeline_parallel`` (or ddp without a pipeline,
        which owns the data-dimension gradient sync mixed_parallel owns), each part where its size is > 1."""
        self.resolve(env)
        pm, own = self._mode(others)
        layout = pm.layout(env.world_size)
        parts: list[Transform] = [pm] if own else []
        if layout.size("tensor") > 1:
            parts.append(TensorParallel(plan=self.tp_plan))
        parts.extend(self._split(layout, others))
        if layout.size("pipeline") > 1:
            parts.append(
                PipelineParallel(
                    microbatches=self.microbatches, schedule=self.schedule, stages_per_rank=self.stages_per_rank
                )
            )
        else:
            parts.append(Ddp())
        return tuple(parts)

    def check(self, model, degree: int = 1) -> list[str]:
        """tensor_parallel's planning check at this step's tensor degree (the search rules out a
        candidate whose model cannot be sharded before it costs a trial)."""
        degree = self.tensor or degree
        return TensorParallel(plan=self.tp_plan).check(model, degree) if degree > 1 else []

    def apply(self, state, ctx):
        raise CompositionError(
            "mixed_parallel is expanded by compose() into its parts (see explain()); apply the plan, not the step"
        )


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
