"""Tiny mixture-of-experts models as users build them: transformers 5's MoE families from their
configs (defaults on, width 32, 2 layers, 4 heads, 2 key/value heads, 4 experts, top-2 unless the
family says otherwise) and a plain user model whose experts module follows the experts protocol
(composable_atorch.transforms.parallel.expert.families).

    model = build(name)                 # seeded: the same weights on every call
    ids = batch(seed)                   # a global batch of token ids
    loss(name, model, ids)

``FAMILIES`` are the expert-parallel tests' first families; ``CONFIGS`` holds every family (the
expert zoo's too); ``"user"`` is :class:`UserMoEModel`.
"""

from __future__ import annotations

import torch
from torch import nn

from zoo.configs import SEQ, VOCAB, cfg, deepseek_v3, qwen2_moe, shape
from zoo.user import UserModel

__all__ = ["SEQ", "VOCAB"]

_SHAPE = shape(32, num_key_value_heads=2)
_E = {"num_experts": 4, "num_experts_per_tok": 2}
_LOCAL = {"num_local_experts": 4, "num_experts_per_tok": 2}
_ROUTED = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_group": 1, "topk_group": 1}

#: family -> (config class, its fields beyond the common shape)
_FIELDS = {
    "mixtral": ("MixtralConfig", _LOCAL),
    "qwen3_moe": ("Qwen3MoeConfig", {**_E, "moe_intermediate_size": 32, "head_dim": 8}),
    "gpt_oss": ("GptOssConfig", {**_LOCAL, "intermediate_size": 32, "head_dim": 8}),
    "olmoe": ("OlmoeConfig", _E),
    "qwen2_moe_plain": ("Qwen2MoeConfig", {**_E, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}),
    "qwen3_moe_sparse_step": (
        "Qwen3MoeConfig",
        {**_E, "moe_intermediate_size": 16, "head_dim": 8, "decoder_sparse_step": 2, "mlp_only_layers": []},
    ),
    "granitemoe": ("GraniteMoeConfig", _LOCAL),
    "granitemoeshared": ("GraniteMoeSharedConfig", {**_LOCAL, "shared_intermediate_size": 16}),
    "phimoe": ("PhimoeConfig", _LOCAL),
    "deepseek_v2": (
        "DeepseekV2Config",
        {**_ROUTED, "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None}
        | {"qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8},
    ),
    "llama4_text": (
        "Llama4TextConfig",
        {**_LOCAL, "num_experts_per_tok": 1, "intermediate_size_mlp": 64, "head_dim": 8, "attention_chunk_size": 8},
    ),
    "jamba": (
        "JambaConfig",
        {**_E, "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 2, "attn_layer_offset": 0}
        | {"mamba_d_state": 4, "mamba_d_conv": 2, "mamba_expand": 2, "use_mamba_kernels": False},
    ),
    "glm4_moe": ("Glm4MoeConfig", {**_ROUTED, "first_k_dense_replace": 1, "head_dim": 8}),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 16, "moe_layer_start_index": 0},
    ),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", {"num_experts": 4, "moe_topk": 2, "head_dim": 8}),
    "minimax": ("MiniMaxConfig", {**_LOCAL, "head_dim": 8}),
    "flex_olmo": ("FlexOlmoConfig", {**_E, "pad_token_id": 0}),
}


def _jetmoe():
    # JetMoE sizes its attention by kv_channels, not by the common shape's heads
    fields = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_key_value_heads": 2}
    return cfg("JetMoeConfig", **fields, kv_channels=8, intermediate_size=32, **_LOCAL)


#: family -> its config (a new object on every call)
CONFIGS = {name: (lambda cls=cls, more=more: cfg(cls, **_SHAPE | more)) for name, (cls, more) in _FIELDS.items()}
CONFIGS.update(
    jetmoe=_jetmoe,
    qwen2_moe=lambda: qwen2_moe(32, moe=32, shared=32),
    # grouped routing (2 groups of 2 experts, top-1 group), a shared expert, the first layer dense
    deepseek_v3=lambda: deepseek_v3(32, moe=16, q_lora=16, v_head=8, n_group=2),
)

#: the expert-parallel tests' first families
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
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if name == "user":
        return UserMoEModel(vocab=vocab)
    return AutoModelForCausalLM.from_config(CONFIGS[name]())


def batch(seed: int, size: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(1, VOCAB, (size, SEQ), generator=g)


def loss(name: str, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if name == "user":
        return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    return model(input_ids=ids, labels=ids).loss
