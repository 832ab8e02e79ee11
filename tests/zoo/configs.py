"""The families' transformers configs, once, at the sizes the test modules ask for.

Configs are built as users build them: the family's defaults left on (``use_cache`` included: a model
then builds a key/value cache in every training forward, which transforms must handle), tiny sizes,
no download. Each test module picks its width (64 for the zoo's cross-transform matrix, 32 for the
pipeline, tensor-parallel and MoE tests); what differs between them is passed as fields.
"""

from __future__ import annotations

VOCAB, SEQ = 128, 16


def cfg(cls_name: str, **fields):
    """``transformers.<cls_name>(**fields)``; bos / eos inside the tiny vocabulary (the families'
    default special tokens lie outside it) unless ``fields`` say otherwise."""
    import transformers

    return getattr(transformers, cls_name)(**{"bos_token_id": 1, "eos_token_id": 2, **fields})


def shape(width: int, **fields) -> dict:
    """The common decoder / encoder shape: 2 layers of ``width``, 4 heads, an MLP twice as wide."""
    return attention(width, intermediate_size=2 * width, **fields)


def attention(width: int, **fields) -> dict:
    """:func:`shape` less the MLP width, for families that name it otherwise (OPT's ``ffn_dim``) or not at all."""
    return {"vocab_size": VOCAB, "hidden_size": width, "num_hidden_layers": 2, "num_attention_heads": 4, **fields}


def llama_config(width: int = 32, layers: int = 2, vocab: int = VOCAB, **fields):
    """A tiny ``LlamaConfig``: :func:`shape` with 2 key/value heads, ``fields`` over it."""
    sizes = shape(width, vocab_size=vocab, num_hidden_layers=layers, num_key_value_heads=2)
    return cfg("LlamaConfig", **sizes | fields)


def gpt2_config(width: int = 32, layers: int = 2, vocab: int = VOCAB, **fields):
    """A tiny ``GPT2Config`` (4 heads, 64 positions), ``fields`` over it."""
    sizes = {"vocab_size": vocab, "n_embd": width, "n_layer": layers, "n_head": 4, "n_positions": 64}
    return cfg("GPT2Config", **sizes | fields)


def vit(width: int, image: int, patch: int, labels: int, **fields):
    return cfg("ViTConfig", **_vision(width, image, patch), num_labels=labels, **fields)


def _vision(width: int, image: int, patch: int) -> dict:
    shared = shape(width, image_size=image, patch_size=patch)
    del shared["vocab_size"]
    return shared


def convnext(hidden_sizes: list[int], depths: list[int], image: int, labels: int, **fields):
    """Two stages of depthwise convs and pointwise Linear pairs, a classification head."""
    return cfg(
        "ConvNextConfig",
        num_channels=3,
        num_stages=2,
        hidden_sizes=hidden_sizes,
        depths=depths,
        image_size=image,
        num_labels=labels,
        **fields,
    )


def clip(width: int, image: int, patch: int, projection: int, positions: int):
    """Two towers, text (``positions`` long) and vision, projected to ``projection``."""
    text = shape(width, max_position_embeddings=positions, bos_token_id=1, eos_token_id=2)
    return cfg("CLIPConfig", text_config=text, vision_config=_vision(width, image, patch), projection_dim=projection)


def deepseek_v3(width: int, moe: int, q_lora: int, v_head: int, **fields):
    """Latent attention (low-rank q / kv) and 4 routed experts (top-2) with a shared one; layer 0 dense."""
    return cfg(
        "DeepseekV3Config",
        **shape(width, num_key_value_heads=4),
        moe_intermediate_size=moe,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        **{"n_shared_experts": 1, "n_group": 1, "topk_group": 1, **fields},
        q_lora_rank=q_lora,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=v_head,
    )


def qwen2_moe(width: int, moe: int, shared: int, **fields):
    """4 experts (top-2) and a gated shared expert."""
    return cfg(
        "Qwen2MoeConfig",
        **shape(width, num_key_value_heads=2),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=moe,
        shared_expert_intermediate_size=shared,
        **fields,
    )


def lora(model, targets: list[str], **fields):
    """``model`` wrapped by peft: rank-4 LoRA adapters on ``targets``, base weights frozen."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, **fields))
