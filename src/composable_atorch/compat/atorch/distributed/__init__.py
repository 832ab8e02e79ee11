"""``atorch.distributed``: ``seq_all_to_all`` (ATorch's Ulysses primitive, used by models' ``set_sp``)."""

from composable_atorch.compat.atorch.distributed.seq_comm import seq_all_to_all

__all__ = ["seq_all_to_all"]
