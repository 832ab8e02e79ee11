"""``atorch.auto.accelerate``."""

from composable_atorch.compat.accelerate import AccelerateResult, auto_accelerate

__all__ = ["AccelerateResult", "auto_accelerate"]
