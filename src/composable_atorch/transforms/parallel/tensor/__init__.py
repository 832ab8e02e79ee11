"""Tensor parallelism on DTensor (Megatron's sequence parallelism is ``tensor_parallel(sequence_parallel=True)``):
the transform (``transform``), what it shards
(``planner``: ``TPInfo``, plan normalisation, the auto planner over ``graph``'s traced pairs;
``resolve``: the checks at one rank's shapes, failing pairs kept whole),
dropout streams across tensor ranks (``dropout``) and checkpoints of fused projections in the
user's layout (``layout``).
"""

from composable_atorch.transforms.parallel.tensor.layout import load_layout, save_layout
from composable_atorch.transforms.parallel.tensor.planner import (
    TensorParallelPlanError,
    TPInfo,
    auto_plan,
    is_conv1d,
    is_linear,
    normalize_plan,
)
from composable_atorch.transforms.parallel.tensor.transform import (
    TensorParallel,
    full_weight,
    tensor_parallel,
)

__all__ = [
    "TPInfo",
    "TensorParallel",
    "TensorParallelPlanError",
    "auto_plan",
    "full_weight",
    "is_conv1d",
    "is_linear",
    "load_layout",
    "normalize_plan",
    "save_layout",
    "tensor_parallel",
]
