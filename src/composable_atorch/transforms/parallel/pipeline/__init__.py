"""Pipeline parallelism on ``torch.distributed.pipelining``: the transform and its schedules
(``transform``) and the cutting of a model into stages (``stages``: pure module surgery).
"""

from composable_atorch.transforms.parallel.pipeline.stages import PipelineLoopError, anatomy, balanced_cuts
from composable_atorch.transforms.parallel.pipeline.transform import (
    SCHEDULES,
    PipelineParallel,
    pipeline_parallel,
)

__all__ = ["SCHEDULES", "PipelineLoopError", "PipelineParallel", "anatomy", "balanced_cuts", "pipeline_parallel"]
