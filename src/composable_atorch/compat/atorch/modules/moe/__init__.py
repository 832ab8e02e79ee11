"""``atorch.modules.moe``: ATorch's own MoE layers (``MOELayer``, ``Experts``, gates) are not built here.

Expert parallelism here works on the model's own experts module: transformers 5's MoE families
(Mixtral, Qwen2/3-MoE, DeepSeek-V3, GPT-OSS) or a user module following the experts protocol in
``composable_atorch.transforms.parallel.expert.families``, split over parallel_mode's
``("expert", n)`` by ``expert_parallel()``. Building one of ATorch's classes says so.
"""

from __future__ import annotations

from composable_atorch.errors import ConfigError

USE_INSTEAD = (
    "a transformers MoE model or your own experts module (the experts protocol in "
    "composable_atorch.transforms.parallel.expert.families) with load_strategy "
    "[('parallel_mode', ([('expert', n), ('expert_fsdp', m)], None)), 'expert_parallel']; "
    "ATorch's own MoE layers are not built here"
)


class _NotBuilt:
    def __init__(self, *args, **kwargs):
        raise ConfigError(f"atorch.modules.moe.{type(self).__name__}", "not built here", USE_INSTEAD)


class MOELayer(_NotBuilt):
    pass


class Experts(_NotBuilt):
    pass


class SwitchGate(_NotBuilt):
    pass


class TopkGate(_NotBuilt):
    pass


__all__ = ["Experts", "MOELayer", "SwitchGate", "TopkGate"]
