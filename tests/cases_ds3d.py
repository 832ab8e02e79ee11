"""Registry-matrix case for ds_3d_parallel (world 2: a 2-stage DeepSpeed pipeline of the tests' GPT).

The GPT is a real (not recorded) model: each stage copies its layers with their weights; the
built-in GPT patcher adds the position embeddings. Each rank holds its stage's parameters only.
"""

from composable_atorch import ds_3d_parallel, parallel_mode

from matrix import Case

CASES = {
    "ds_3d_parallel": Case(
        lambda: ds_3d_parallel(tie_first=False),
        world=2,
        extra=lambda: (parallel_mode([("pipeline", 2)]),),
        names_kept=False,
    ),
}
