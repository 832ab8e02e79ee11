"""``atorch.utils``."""
