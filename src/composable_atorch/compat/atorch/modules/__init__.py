"""``atorch.modules``."""
