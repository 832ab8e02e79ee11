"""DeepSpeed 3-D parallelism (``ds_3d_parallel``): the transform and ATorch's config (``transform``),
the ``PipelineModule`` built from a recorded model (``build``), the engine's config, topology and
step (``engine``) and Megatron-style tensor parallelism on plain tensors (``tp``).
"""

from composable_atorch.transforms.parallel.ds3d.transform import (
    DeepSpeed3DParallel,
    DeepSpeed3DParallelConfig,
    ds_3d_parallel,
)

__all__ = ["DeepSpeed3DParallel", "DeepSpeed3DParallelConfig", "ds_3d_parallel"]
