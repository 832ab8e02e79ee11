"""``atorch.common``."""
