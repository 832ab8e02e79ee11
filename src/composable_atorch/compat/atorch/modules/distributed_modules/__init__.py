"""``atorch.modules.distributed_modules``."""
