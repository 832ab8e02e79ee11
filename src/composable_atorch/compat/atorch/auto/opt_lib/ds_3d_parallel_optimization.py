"""``atorch.auto.opt_lib.ds_3d_parallel_optimization``."""

from composable_atorch.transforms.parallel.ds3d import DeepSpeed3DParallelConfig

__all__ = ["DeepSpeed3DParallelConfig"]
