"""``atorch.auto.model_context``: only the helper ATorch's examples import from it (its ModelContext
is internal to ATorch's engine, which has no counterpart here)."""

from composable_atorch.compat.atorch.distributed.distributed import get_data_partition_rank_and_size

__all__ = ["get_data_partition_rank_and_size"]
