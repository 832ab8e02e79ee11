"""Tiny models the pipeline tests need beyond tests/zoo.py, built as users build them (transformers
configs with their defaults left on, ``use_cache`` included).

    model = build("gemma2")             # seeded: the same weights on every call
    ids = batch(seed=0)                 # a global batch of token ids

Families that choose each layer's attention by its index in ``config.layer_types`` (sliding window
of 4 tokens at sequence 16, so the window matters), encoders (ViT, DeBERTa-v2, BERT), a LoRA-wrapped
Llama and plain user models with a block list.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128
SEQ = 16
WINDOW = 4
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
_ALTERNATING = ["sliding_attention", "full_attention"]


def _cfg(cls_name: str, **fields):
    import transformers

    return getattr(transformers, cls_name)(**{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **fields})


#: causal LMs whose layers read ``config.layer_types[i]`` (2 layers, sliding then full:
#: stage 1's full-attention layer is the first of its stage)
LAYER_TYPED = {
    "gemma2": lambda: _cfg("Gemma2Config", **_SMALL, num_hidden_layers=2, head_dim=8, sliding_window=WINDOW),
    "gpt_oss": lambda: _cfg(
        "GptOssConfig",
        **_SMALL,
        num_hidden_layers=2,
        head_dim=8,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "cohere2": lambda: _cfg(
        "Cohere2Config", **_SMALL, num_hidden_layers=2, sliding_window=WINDOW, layer_types=list(_ALTERNATING)
    ),
    "gemma3": lambda: _cfg(
        "Gemma3TextConfig",
        **_SMALL,
        num_hidden_layers=2,
        head_dim=8,
        sliding_window=WINDOW,
        layer_types=list(_ALTERNATING),
    ),
    # Qwen2 with sliding layers from max_window_layers on: full, sliding
    "qwen2_window": lambda: _cfg(
        "Qwen2Config",
        **_SMALL,
        num_hidden_layers=2,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    ),
}


def build(name: str, seed: int = 0) -> nn.Module:
    """The tiny model ``name``, weights fixed by ``seed``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LAYER_TYPED[name]())


def build_layers(name: str, layers: int, seed: int = 0) -> nn.Module:
    """``name`` with ``layers`` layers (the layer types repeat the family's pattern)."""
    from transformers import AutoModelForCausalLM

    cfg = LAYER_TYPED[name]()
    cfg.num_hidden_layers = layers
    cfg.layer_types = [cfg.layer_types[i % len(cfg.layer_types)] for i in range(layers)]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


def batch(seed: int = 0, size: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randint(3, VOCAB, (size, SEQ), generator=g)


def llama(layers: int = 4, tie: bool = False) -> nn.Module:
    """A tiny transformers Llama (use_cache left on), ``layers`` decoder layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_SMALL, num_hidden_layers=layers, tie_word_embeddings=tie))


class Block(nn.Module):
    """A user's residual MLP block."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class UserNet(nn.Module):
    """A plain user model: embedding, a list of blocks, a head (no library conventions)."""

    def __init__(self, layers: int = 4, d: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def user(layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return UserNet(layers)


IMAGE = 16
#: encoders and wrapped models (2-4 blocks each); their batches below
ENCODERS = {
    "vit": lambda: _cfg(
        "ViTConfig",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=IMAGE,
        patch_size=4,
        num_labels=5,
    ),
    "bert": lambda: _cfg(
        "BertConfig",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    ),
    "deberta_v2": lambda: _cfg(
        "DebertaV2Config",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    ),
    # DeBERTa-v3 style: relative attention, its position table and norm given to every layer
    "deberta_rel": lambda: _cfg(
        "DebertaV2Config",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        relative_attention=True,
        position_buckets=8,
        norm_rel_ebd="layer_norm",
        pos_att_type=["p2c", "c2p"],
        position_biased_input=False,
    ),
    "convnext": lambda: _cfg(
        "ConvNextConfig",
        num_channels=3,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
        image_size=IMAGE,
        num_labels=5,
    ),
}


def encoder(name: str, seed: int = 0) -> nn.Module:
    """ViT / ConvNeXt image classifiers, BERT / DeBERTa-v2 masked LMs."""
    import transformers

    torch.manual_seed(seed)
    cfg = ENCODERS[name]()
    cls = {"vit": "ViTForImageClassification", "convnext": "ConvNextForImageClassification"}.get(name)
    if cls is None:
        return transformers.AutoModelForMaskedLM.from_config(cfg)
    return getattr(transformers, cls)(cfg)


def lora_llama(seed: int = 0) -> nn.Module:
    """A LoRA-wrapped tiny Llama (peft's PeftModelForCausalLM): only the adapters train."""
    from peft import LoraConfig, get_peft_model

    model = llama(layers=2)
    torch.manual_seed(seed)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, lora)


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
