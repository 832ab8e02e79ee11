"""Which modules hold experts: transformers 5's 3-D expert modules and user modules that follow
the same protocol.

**The experts protocol** (what transformers 5's ``MixtralExperts``, ``Qwen2MoeExperts``,
``Qwen3MoeExperts``, ``DeepseekV3Experts`` and ``GptOssExperts`` do, and what a user's module
must do to be split):

* an integer attribute ``num_experts`` (E);
* every parameter, its own or a child's, is stacked over experts: ``param.shape[0] == E``
  (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, GPT-OSS's biases ``[E, ...]``);
* ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` returns
  ``sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t])`` for each token
  ``t`` on its own (no mixing of tokens), reading ``self.num_experts`` for how many experts it holds
  and indexing its parameters by expert id.

The router (``gate``/``router``), shared experts and any load-balancing loss live outside this
module, in the MoE block, and stay as they are. A model whose mixture of experts is written
another way (an ``nn.ModuleList`` of expert MLPs, a forward that takes the router logits) is a
:class:`ExpertParallelError` naming those modules and the protocol.
"""

from __future__ import annotations

import inspect

from torch import nn

from composable_atorch.errors import ConfigError

#: transformers 5's expert classes, by class name -> the family explain() names.
KNOWN = {
    "MixtralExperts": "Mixtral",
    "Qwen2MoeExperts": "Qwen2-MoE",
    "Qwen3MoeExperts": "Qwen3-MoE",
    "DeepseekV3Experts": "DeepSeek-V3",
    "GptOssExperts": "GPT-OSS",
}

PROTOCOL = (
    "an experts module with an integer num_experts, every parameter stacked over experts "
    "(shape [num_experts, ...]) and forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) "
    "-> [T, H] (transformers 5's MixtralExperts form; see composable_atorch.transforms.parallel.expert.families)"
)


class ExpertParallelError(ConfigError):
    """The model has no module expert parallelism can split, or experts that cannot be split evenly."""

    def __init__(self, problem: str, names):
        self.problem, self.names = problem, list(names)
        shown = ", ".join(self.names[:8]) + (" ..." if len(self.names) > 8 else "")
        super().__init__("expert_parallel model", shown or "(no module)", f"{problem}; expected {PROTOCOL}")


def _forward_arity(module: nn.Module) -> int:
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return -1
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def follows_protocol(module: nn.Module) -> bool:
    e = getattr(module, "num_experts", None)
    if isinstance(e, bool) or not isinstance(e, int) or e < 1:
        return False
    params = list(module.parameters())
    return bool(params) and all(p.dim() >= 1 and p.shape[0] == e for p in params) and _forward_arity(module) >= 3


def family(module: nn.Module) -> str:
    return KNOWN.get(type(module).__name__, f"user {type(module).__name__}")


def _looks_like_moe(name: str, module: nn.Module) -> bool:
    leaf = name.rpartition(".")[2].lower()
    return "expert" in type(module).__name__.lower() or leaf in ("experts", "moe") or leaf.endswith("_experts")


def find_experts(model: nn.Module, degree: int) -> dict[str, nn.Module]:
    """``{qualified name: experts module}`` for every module following the protocol, outermost first.

    ExpertParallelError when there is none (naming the modules that look like a mixture of experts
    written another way) or when an expert count does not divide by ``degree``.
    """
    found: dict[str, nn.Module] = {}
    inside: set[int] = set()
    for name, m in model.named_modules():
        if id(m) in inside:
            continue
        if follows_protocol(m):
            found[name] = m
            inside.update(id(s) for s in m.modules())
    if not found:
        odd = [f"{n or '(root)'} ({type(m).__name__})" for n, m in model.named_modules() if _looks_like_moe(n, m)]
        if odd:
            raise ExpertParallelError("these modules look like experts but do not follow the experts protocol", odd)
        raise ExpertParallelError("the model has no mixture-of-experts layer to split over the expert dimension", [])
    uneven = [f"{n}: {m.num_experts} experts" for n, m in found.items() if m.num_experts % degree]
    if uneven:
        raise ExpertParallelError(f"expert counts must divide by the expert degree {degree}", uneven)
    return found
