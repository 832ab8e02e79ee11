"""``atorch.tensor_parallel.manual_tp``."""

from composable_atorch.transforms.parallel.tensor import TPInfo

__all__ = ["TPInfo"]
