"""``atorch.auto``: the facade."""

from composable_atorch.compat.accelerate import auto_accelerate

__all__ = ["auto_accelerate"]
