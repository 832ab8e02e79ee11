"""Registry-matrix cases for model parallelism (world 2).

tensor_parallel, pipeline_parallel, mixed_parallel (ATorch's sequence_parallel is Ulysses: cases_sequence.py).
"""

from composable_atorch import mixed_parallel, parallel_mode, pipeline_parallel, tensor_parallel

from matrix import Case

CASES = {
    "tensor_parallel": Case(lambda: tensor_parallel(), world=2, extra=lambda: (parallel_mode([("tensor", 2)]),)),
    # each rank holds its stage's parameters only: names are kept but a subset
    "pipeline_parallel": Case(
        lambda: pipeline_parallel(microbatches=2),
        world=2,
        extra=lambda: (parallel_mode([("pipeline", 2)]),),
        names_kept=False,
    ),
    # its search candidates include pipeline degrees: then each rank keeps its stage's parameters only
    "mixed_parallel": Case(
        lambda: mixed_parallel(), world=2, extra=lambda: (parallel_mode([("tensor", 2)]),), names_kept=False
    ),
}
