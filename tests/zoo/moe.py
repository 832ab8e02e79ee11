"""MoE families for the expert-parallel zoo beyond tests/moe_models.py: transformers 5 configs with
defaults on, tiny sizes (width 32, 2 layers, 4 heads, 2 key/value heads, 4 experts, top-2)."""

from __future__ import annotations

import torch
from torch import nn

from zoo.configs import cfg, shape

_SHAPE = shape(32, num_key_value_heads=2)
_E = {"num_experts": 4, "num_experts_per_tok": 2}

CONFIGS = {
    "olmoe": lambda: cfg("OlmoeConfig", **_SHAPE, **_E),
    "qwen2_moe_plain": lambda: cfg(
        "Qwen2MoeConfig", **_SHAPE, **_E, moe_intermediate_size=16, shared_expert_intermediate_size=16
    ),
    "qwen3_moe_sparse_step": lambda: cfg(
        "Qwen3MoeConfig",
        **_SHAPE,
        **_E,
        moe_intermediate_size=16,
        head_dim=8,
        decoder_sparse_step=2,
        mlp_only_layers=[],
    ),
    "granitemoe": lambda: cfg("GraniteMoeConfig", **_SHAPE, num_local_experts=4, num_experts_per_tok=2),
    "granitemoeshared": lambda: cfg(
        "GraniteMoeSharedConfig", **_SHAPE, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16
    ),
    "phimoe": lambda: cfg("PhimoeConfig", **_SHAPE, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v2": lambda: cfg(
        "DeepseekV2Config",
        **_SHAPE,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    ),
    "llama4_text": lambda: cfg(
        "Llama4TextConfig",
        **_SHAPE,
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size_mlp=64,
        head_dim=8,
        attention_chunk_size=8,
    ),
    "jamba": lambda: cfg(
        "JambaConfig",
        **_SHAPE,
        num_experts=4,
        num_experts_per_tok=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=2,
        attn_layer_offset=0,
        mamba_d_state=4,
        mamba_d_conv=2,
        mamba_expand=2,
        use_mamba_kernels=False,
    ),
    "jetmoe": lambda: cfg(
        "JetMoeConfig",
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_key_value_heads=2,
        kv_channels=8,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "glm4_moe": lambda: cfg(
        "Glm4MoeConfig",
        **_SHAPE,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        head_dim=8,
        n_group=1,
        topk_group=1,
    ),
    "ernie4_5_moe": lambda: cfg(
        "Ernie4_5_MoeConfig",
        **_SHAPE,
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=16,
        moe_layer_start_index=0,
    ),
    "hunyuan_v1_moe": lambda: cfg("HunYuanMoEV1Config", **_SHAPE, num_experts=4, moe_topk=2, head_dim=8),
    "minimax": lambda: cfg("MiniMaxConfig", **_SHAPE, num_local_experts=4, num_experts_per_tok=2, head_dim=8),
    "flex_olmo": lambda: cfg("FlexOlmoConfig", **_SHAPE, **_E, pad_token_id=0),
}


def build(name: str, seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(CONFIGS[name]())
