"""``atorch.auto.opt_lib``."""
