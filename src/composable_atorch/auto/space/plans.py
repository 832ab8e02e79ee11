"""What a plan is to the search: its identity (:func:`plan_key`), what it asks of the mesh, read from its
steps' typed fields (:func:`parallel_degree`, :func:`sequence_split`: parallel_mode's groups,
mixed_parallel's degrees), and the rules that rule a plan out before it costs a trial (a step's own
planning check refuses the model: :func:`planning_admit`; a pipeline without a criterion:
:func:`plan_needs_criterion`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from composable_atorch.core import codec
from composable_atorch.core.plan import Plan
from composable_atorch.core.registry import axis_owners
from composable_atorch.core.transform import Transform
from composable_atorch.errors import ConfigError
from composable_atorch.transforms.parallel.data import ParallelMode
from composable_atorch.transforms.parallel.mixed import MixedParallel


def plan_key(plan: Plan) -> str:
    """What makes two plans the same plan: their ordered steps and configs (not how they were asked for)."""
    steps = [{"name": t.name, "config": codec.encode(t.config())} for t in plan.transforms]
    return json.dumps(steps, sort_keys=True, separators=(",", ":"))


def label_of(transform: Transform) -> str:
    """A short, stable label for one candidate config (what optuna stores as the categorical value)."""
    return transform.describe()


def axis_of(name: str) -> str | None:
    """The mesh dimension the transform ``name`` owns (its contract's declared axis), or None."""
    return axis_owners().get(name)


def parallel_degree(plan: Plan, dim: str) -> int:
    """The size of ``dim`` ("tensor", "pipeline", "context"...) a plan asks for: the first of its layout
    (parallel_mode's groups) or mixed_parallel's degrees that sets it above 1; 1 when none does."""
    for t in plan.transforms:
        if isinstance(t, ParallelMode):
            sizes = dict(t.groups)
        elif isinstance(t, MixedParallel):
            sizes = {"tensor": t.tensor or 1, "pipeline": t.pipeline or 1}
        else:
            continue
        if sizes.get(dim, 1) > 1:
            return int(sizes[dim])
    return 1


def pipeline_degree(plan: Plan) -> int:
    """The pipeline size a plan asks for (:func:`parallel_degree`). A pipeline needs the loss in
    the ``(output, targets)`` shape of ``train_step`` (see :class:`~composable_atorch.auto.Workload`)."""
    return parallel_degree(plan, "pipeline")


def sequence_split(plan: Plan) -> int:
    """Into how many parts a plan cuts each sequence over its ranks: the size of the dimension each of its
    sequence-splitting steps (role ``sequence_split``) splits; 1 without one."""
    out = 1
    for t in plan.transforms:
        if "sequence_split" in t.contract.roles:
            out *= parallel_degree(plan, axis_of(t.name) or "")
    return out


def checked_dim(transform: Transform) -> str:
    """The mesh dimension whose degree a step's ``check(model, degree)`` takes: its own axis
    (expert_parallel: "expert"), else "tensor" (tensor planning)."""
    return axis_of(transform.name) or "tensor"


def planning_admit(model: torch.nn.Module, then: Callable[[Plan], str | None] | None = None):
    """``admit(plan)`` for :class:`SearchSpace`: a plan with a step whose ``check(model, degree)``
    (model-parallel planning, e.g. tensor_parallel's) refuses ``model`` is invalid at no trial cost;
    ``then`` is the next rule. Checks are cached per (step, degree)."""
    seen: dict = {}

    def admit(plan: Plan) -> str | None:
        for t in plan.transforms:
            if not callable(getattr(t, "check", None)):
                continue
            key = (repr(t), parallel_degree(plan, checked_dim(t)))
            if key not in seen:
                try:
                    t.check(model, key[1])
                    seen[key] = None
                except ConfigError as exc:
                    seen[key] = f"{type(exc).__name__}: {exc}"
            if seen[key]:
                return seen[key]
        return then(plan) if then is not None else None

    return admit


def plan_needs_criterion(plan: Plan) -> str | None:
    """Why a workload without ``criterion`` cannot train ``plan`` (a pipeline runs the loss inside its
    schedule, on the last stage's output: ``loss_fn(model, batch)`` has no place there)."""
    if pipeline_degree(plan) > 1:
        return (
            "RequirementError: a pipeline plan needs Workload.criterion(output, targets) and batches of "
            "(inputs, targets); this workload gives loss_fn(model, batch) only"
        )
    return None
