"""``atorch.local_sgd``."""
