"""Pipeline parallelism on ``torch.distributed.pipelining``: the transform and its schedules
(``transform``) and the cutting of a model into stages (``stages``: the built-in GPT and the
dispatch; ``anatomy``: reading any block-list model; ``cutter``: cutting one stage of it; ``check``:
each stage compared with the whole model, block by block, before training).
"""

from composable_atorch.transforms.parallel.pipeline.anatomy import UncuttableModelError
from composable_atorch.transforms.parallel.pipeline.check import StageMismatchError
from composable_atorch.transforms.parallel.pipeline.stages import PipelineLoopError, anatomy, balanced_cuts
from composable_atorch.transforms.parallel.pipeline.transform import (
    SCHEDULES,
    PipelineParallel,
    pipeline_parallel,
)

__all__ = [
    "SCHEDULES",
    "PipelineLoopError",
    "StageMismatchError",
    "PipelineParallel",
    "UncuttableModelError",
    "anatomy",
    "balanced_cuts",
    "pipeline_parallel",
]
