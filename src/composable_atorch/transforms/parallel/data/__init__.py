"""Data parallelism: ``parallel_mode``, ``ddp``, ``zero1`` (``data_parallel``), ``fsdp`` and ``zero2``
(``sharding``, on torch's FSDP2), their DeepSpeed engine variants (``deepspeed``), and the roles,
conflict reasons and gradient-sync hooks every parallel family shares (``common``).

The lowest room of ``transforms/parallel``: the tensor, pipeline, mixed and DeepSpeed 3-D families
import from here, never the reverse.
"""

from composable_atorch.transforms.parallel.data import deepspeed  # noqa: F401 - registers the DeepSpeed variants
from composable_atorch.transforms.parallel.data.data_parallel import Ddp, ParallelMode, Zero1, ddp, parallel_mode, zero1
from composable_atorch.transforms.parallel.data.sharding import Fsdp, Zero2, fsdp, zero2

__all__ = ["Ddp", "Fsdp", "ParallelMode", "Zero1", "Zero2", "ddp", "fsdp", "parallel_mode", "zero1", "zero2"]
