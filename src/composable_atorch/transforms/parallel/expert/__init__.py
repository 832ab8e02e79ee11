"""Expert parallelism: each rank of the ``expert`` dimension holds 1/n of every MoE layer's experts
(``transform``), tokens reach them by all-to-all (``dispatch``), and the experts modules it can
split are transformers 5's 3-D expert modules or user modules following their protocol (``families``).
"""

from composable_atorch.transforms.parallel.expert.families import PROTOCOL, ExpertParallelError, find_experts
from composable_atorch.transforms.parallel.expert.transform import ExpertParallel, ExpertShard, expert_parallel

__all__ = ["PROTOCOL", "ExpertParallel", "ExpertParallelError", "ExpertShard", "expert_parallel", "find_experts"]
