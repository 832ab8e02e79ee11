"""Data parallelism: ``parallel_mode``, ``ddp``, ``zero1`` (``data_parallel``), ``fsdp`` and ``zero2``
(``sharding``, on torch's FSDP2), their DeepSpeed engine variants (``deepspeed``), and the conflict
reasons, sync hooks and backend variants they share (``common``).

One axis among peers: tensor, pipeline, sequence and expert parallelism do not import it; what they
all share is in ``transforms/parallel/shared``.
"""

from composable_atorch.transforms.parallel.data import deepspeed  # noqa: F401 - registers the DeepSpeed variants
from composable_atorch.transforms.parallel.data.data_parallel import Ddp, ParallelMode, Zero1, ddp, parallel_mode, zero1
from composable_atorch.transforms.parallel.data.sharding import Fsdp, Zero2, fsdp, zero2

__all__ = ["Ddp", "Fsdp", "ParallelMode", "Zero1", "Zero2", "ddp", "fsdp", "parallel_mode", "zero1", "zero2"]
