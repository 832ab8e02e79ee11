"""``atorch.auto.strategy``: ATorch's Strategy is the facade's returned plan, an :class:`AtorchStrategy`."""

from composable_atorch.compat.accelerate import AtorchStrategy, StrategyEntry

Strategy = AtorchStrategy

__all__ = ["AtorchStrategy", "Strategy", "StrategyEntry"]
