"""The search space: the knobs the registered kinds form (:mod:`.knobs`, with the ``parallel_mode`` knob
of the axes' degrees), what a plan is to the search (:mod:`.plans`: its key, what it asks of the mesh,
the rules that rule it out before a trial) and the space itself (:mod:`.searchspace`: the assignments,
compose() as the constraint, the enumeration).
"""

from composable_atorch.auto.space.knobs import ABSENT, KNOB, Degrees, canonical_kind, dimensions
from composable_atorch.auto.space.plans import (
    axis_of,
    checked_dim,
    label_of,
    parallel_degree,
    pipeline_degree,
    plan_key,
    plan_needs_criterion,
    planning_admit,
    sequence_split,
)
from composable_atorch.auto.space.searchspace import Enumeration, Point, SearchSpace, build_space
from composable_atorch.auto.workload import block_classes, example_model

__all__ = [
    "ABSENT",
    "KNOB",
    "Degrees",
    "Enumeration",
    "Point",
    "SearchSpace",
    "axis_of",
    "block_classes",
    "build_space",
    "canonical_kind",
    "checked_dim",
    "dimensions",
    "example_model",
    "label_of",
    "parallel_degree",
    "pipeline_degree",
    "plan_key",
    "plan_needs_criterion",
    "planning_admit",
    "sequence_split",
]
