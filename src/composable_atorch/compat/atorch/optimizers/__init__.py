"""``atorch.optimizers``: ATorch's own optimizers are not built here; using one says what to use."""

from __future__ import annotations

from composable_atorch.errors import ConfigError


class _NotBuilt:
    use_instead = ""

    def __init__(self, *args, **kwargs):
        raise ConfigError(f"atorch.optimizers.{type(self).__name__}", "not built here", self.use_instead)


class AGD(_NotBuilt):
    """ATorch's AGD (auto-switching SGD/Adam with a diagonal preconditioner)."""

    use_instead = "torch.optim.AdamW (or any torch optimizer) as optim_func; AGD is ATorch's own and not built here"


class WeightedSAM(_NotBuilt):
    use_instead = "a torch optimizer as optim_func; ATorch's WSAM (sharpness-aware) is not built here"


__all__ = ["AGD", "WeightedSAM"]
