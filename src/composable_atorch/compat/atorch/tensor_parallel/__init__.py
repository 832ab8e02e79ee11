"""``atorch.tensor_parallel``."""
