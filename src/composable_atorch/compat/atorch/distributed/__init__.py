"""``atorch.distributed``."""
