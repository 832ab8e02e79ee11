"""``atorch.local_sgd.HSDP``: ATorch's local SGD over hybrid-sharded FSDP is not built here.

Making one of its config objects raises a ConfigError naming what to use: synchronous data
parallelism (``fsdp`` / ``ddp``), where every step averages gradients, or torch's own
``torch.distributed.algorithms.model_averaging`` for periodic averaging in a script of your own.
"""

from __future__ import annotations

from composable_atorch.errors import ConfigError

_INSTEAD = (
    "fsdp / ddp in the strategy (every step synchronized); for local SGD, torch's "
    "torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager in your own loop"
)


class LocalSGDConfigs:
    def __init__(self, *args, **kwargs):
        raise ConfigError("atorch.local_sgd.HSDP.LocalSGDConfigs", "not built here", _INSTEAD)


class OuterOptimizerConfigs:
    def __init__(self, *args, **kwargs):
        raise ConfigError("atorch.local_sgd.HSDP.OuterOptimizerConfigs", "not built here", _INSTEAD)


__all__ = ["LocalSGDConfigs", "OuterOptimizerConfigs"]
