"""Tiny mixture-of-experts models as users build them: transformers 5's MoE families from their
configs (defaults on, tiny sizes, 4 experts, top-2) and a plain user model whose experts module
follows the experts protocol (composable_atorch.transforms.parallel.expert.families).
"""

from __future__ import annotations

import torch
from torch import nn

from zoo.configs import SEQ, VOCAB, cfg, deepseek_v3, qwen2_moe, shape
from zoo.user import UserModel

__all__ = ["SEQ", "VOCAB"]

#: width 32, 2 layers, 2 key/value heads; 4 experts, top-2 in every family
_SHAPE = shape(32, num_key_value_heads=2)


def _config(name: str):
    if name == "mixtral":
        return cfg("MixtralConfig", **_SHAPE, num_local_experts=4, num_experts_per_tok=2)
    if name == "qwen3_moe":
        return cfg(
            "Qwen3MoeConfig", **_SHAPE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=8
        )
    if name == "qwen2_moe":
        return qwen2_moe(32, moe=32, shared=32)
    if name == "deepseek_v3":
        # grouped routing (2 groups of 2 experts, top-1 group), a shared expert, the first layer dense
        return deepseek_v3(32, moe=16, q_lora=16, v_head=8, n_group=2)
    if name == "gpt_oss":
        return cfg(
            "GptOssConfig", **_SHAPE | {"intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2, head_dim=8
        )
    raise KeyError(name)


FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")


class UserExperts(nn.Module):
    """A user's experts module following the protocol: ``num_experts``, parameters stacked over experts,
    ``forward(x [T, H], top_k_index [T, k], top_k_weights [T, k])``."""

    def __init__(self, num_experts: int = 4, d: int = 32, hidden: int = 64):
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(num_experts, d, hidden) * d**-0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden, d) * hidden**-0.5)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            y = torch.relu(x[token] @ self.w_in[e]) @ self.w_out[e]
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class UserMoE(nn.Module):
    def __init__(self, d: int = 32, num_experts: int = 4, k: int = 2):
        super().__init__()
        self.k = k
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, num_experts, bias=False)
        self.experts = UserExperts(num_experts, d)

    def forward(self, h):
        b, t, d = h.shape
        x = self.norm(h).reshape(-1, d)
        weights, index = torch.softmax(self.router(x), dim=-1).topk(self.k, dim=-1)
        return h + self.experts(x, index, weights).reshape(b, t, d)


class UserMoEModel(UserModel):
    """The zoo's user model with MoE blocks: embedding, two MoE blocks, a norm and a head: ids -> logits."""

    def __init__(self, vocab: int = 256, d: int = 32):
        super().__init__(vocab, d, layers=2, block=UserMoE)


def build(name: str, seed: int = 0, vocab: int = VOCAB) -> nn.Module:
    """The family ``name`` (``"user"``: :class:`UserMoEModel` over ``vocab`` ids), weights fixed by ``seed``."""
    torch.manual_seed(seed)
    if name == "user":
        return UserMoEModel(vocab=vocab)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(_config(name))


def batch(seed: int, size: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(1, VOCAB, (size, SEQ), generator=g)


def loss(name: str, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if name == "user":
        return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    return model(input_ids=ids, labels=ids).loss
