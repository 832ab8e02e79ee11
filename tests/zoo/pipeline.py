"""Tiny models the pipeline tests need beyond the zoo, at width 32 (configs from :mod:`zoo.configs`).

    model = build("gemma2")             # seeded: the same weights on every call
    ids = batch(seed=0)                 # a global batch of token ids

Families that choose each layer's attention by its index in ``config.layer_types`` (sliding window
of 4 tokens at sequence 16, so the window matters), encoders (ViT, ConvNeXt, DeBERTa-v2, BERT), a
LoRA-wrapped Llama and plain user models with a block list.
"""

from __future__ import annotations

import torch
from torch import nn

from zoo.configs import SEQ, VOCAB, cfg, convnext, lora, shape, vit
from zoo.user import Block, UserNet  # noqa: F401 - the pipeline tests' user model

__all__ = ["SEQ", "VOCAB", "Block", "UserNet"]

WINDOW = 4
IMAGE = 16
_ALTERNATING = ["sliding_attention", "full_attention"]
#: width 32, 2 key/value heads, padding id 0
_SMALL = shape(32, num_key_value_heads=2, pad_token_id=0)


#: causal LMs whose layers read ``config.layer_types[i]`` (2 layers, sliding then full:
#: stage 1's full-attention layer is the first of its stage)
LAYER_TYPED = {
    "gemma2": lambda: cfg("Gemma2Config", **_SMALL, head_dim=8, sliding_window=WINDOW),
    "gpt_oss": lambda: cfg(
        "GptOssConfig", **_SMALL, head_dim=8, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2
    ),
    "cohere2": lambda: cfg("Cohere2Config", **_SMALL, sliding_window=WINDOW, layer_types=list(_ALTERNATING)),
    "gemma3": lambda: cfg(
        "Gemma3TextConfig", **_SMALL, head_dim=8, sliding_window=WINDOW, layer_types=list(_ALTERNATING)
    ),
    # Qwen2 with sliding layers from max_window_layers on: full, sliding
    "qwen2_window": lambda: cfg(
        "Qwen2Config", **_SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
}


def build(name: str, seed: int = 0) -> nn.Module:
    """The tiny model ``name``, weights fixed by ``seed``."""
    return build_layers(name, None, seed)


def build_layers(name: str, layers: int | None, seed: int = 0) -> nn.Module:
    """``name`` with ``layers`` layers (the layer types repeat the family's pattern; None: its 2)."""
    from transformers import AutoModelForCausalLM

    config = LAYER_TYPED[name]()
    if layers is not None:
        config.num_hidden_layers = layers
        config.layer_types = [config.layer_types[i % len(config.layer_types)] for i in range(layers)]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def batch(seed: int = 0, size: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randint(3, VOCAB, (size, SEQ), generator=g)


def llama(layers: int = 4, tie: bool = False) -> nn.Module:
    """A tiny transformers Llama (use_cache left on, no padding id), ``layers`` decoder layers."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = cfg("LlamaConfig", **shape(32, num_key_value_heads=2, num_hidden_layers=layers), tie_word_embeddings=tie)
    return LlamaForCausalLM(config)


def user(layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return UserNet(layers)


#: encoders (2 blocks each, 5 labels for the image classifiers); their batches below
_ENCODER = shape(32, max_position_embeddings=64, pad_token_id=0)
ENCODERS = {
    "vit": lambda: vit(32, IMAGE, 4, 5, pad_token_id=0),
    "bert": lambda: cfg("BertConfig", **_ENCODER),
    "deberta_v2": lambda: cfg("DebertaV2Config", **_ENCODER),
    # DeBERTa-v3 style: relative attention, its position table and norm given to every layer
    "deberta_rel": lambda: _deberta(8, -1, False, "layer_norm", ["p2c", "c2p"], False),
    # relative-position variants (buckets, max_relative_positions, share_att_key, norm_rel_ebd,
    # pos_att_type, position_biased_input); deberta_v3 is microsoft/deberta-v3's own setting
    "deberta_v3": lambda: _deberta(8, SEQ, True, "layer_norm", ["p2c", "c2p"], False),
    "deberta_c2p": lambda: _deberta(-1, SEQ, False, "none", ["c2p"], True),
    "deberta_p2c": lambda: _deberta(4, SEQ, True, "none", ["p2c"], True),
    "convnext": lambda: convnext([8, 16], [1, 1], IMAGE, 5, pad_token_id=0),
}


#: encoders trained on plain token tensors (no mask: the model builds its own) rather than padded dicts
UNPADDED = ("deberta_v3", "deberta_p2c")


def _deberta(buckets: int, max_relative: int, share_key: bool, norm: str, att: list[str], biased: bool):
    """A DeBERTa-v2 with relative attention, its relative-position settings as a user sets them."""
    return cfg(
        "DebertaV2Config",
        **_ENCODER,
        relative_attention=True,
        position_buckets=buckets,
        max_relative_positions=max_relative,
        share_att_key=share_key,
        norm_rel_ebd=norm,
        pos_att_type=att,
        position_biased_input=biased,
    )


def encoder(name: str, seed: int = 0) -> nn.Module:
    """ViT / ConvNeXt image classifiers, BERT / DeBERTa-v2 masked LMs."""
    import transformers

    torch.manual_seed(seed)
    config = ENCODERS[name]()
    cls = {"vit": "ViTForImageClassification", "convnext": "ConvNextForImageClassification"}.get(name)
    if cls is None:
        return transformers.AutoModelForMaskedLM.from_config(config)
    return getattr(transformers, cls)(config)


def lora_llama(seed: int = 0) -> nn.Module:
    """A LoRA-wrapped tiny Llama (peft's PeftModelForCausalLM) on q/v: only the adapters train."""
    model = llama(layers=2)
    torch.manual_seed(seed)
    return lora(model, ["q_proj", "v_proj"], init_lora_weights=False)


def images(seed: int = 0, size: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + seed)
    return torch.randn(size, 3, IMAGE, IMAGE, generator=g)


def labels(seed: int = 0, size: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(4000 + seed)
    return torch.randint(0, 5, (size,), generator=g)


def padded(seed: int = 0, size: int = 4) -> dict:
    """A padded text batch: ids and the attention mask (each row keeps 8..16 tokens, the rest pad 0)."""
    ids = batch(seed, size)
    g = torch.Generator().manual_seed(5000 + seed)
    lengths = torch.randint(8, SEQ + 1, (size,), generator=g)
    mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return {"input_ids": ids * mask, "attention_mask": mask}
