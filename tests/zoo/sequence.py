"""Tiny transformers models for the sequence-split zoo (context parallel all-gather / ring, Ulysses),
at sequence 64 over the byte vocabulary of :class:`composable_atorch.data.TextDataset` (256).

Defaults left on (``use_cache`` too); sizes tiny: width 32, 4 heads, 2 key/value heads, 2 layers.
Sliding windows are 8 tokens (the families' 4096 would not matter at 64 tokens) and Gemma-2's logit
cap is 1.0 (its default 50 changes tiny logits by less than the tolerance), so a split that ignored
either would fail the comparison with one process.
"""

from __future__ import annotations

import torch
from torch import nn

from zoo.configs import cfg, shape

VOCAB, WINDOW = 256, 8
_SMALL = shape(32, vocab_size=VOCAB, num_key_value_heads=2, pad_token_id=0)
_ALTERNATING = ["sliding_attention", "full_attention"]

#: causal LMs: name -> config
DECODERS = {
    "mistral": lambda: cfg("MistralConfig", **_SMALL, head_dim=8, sliding_window=WINDOW),
    "qwen2": lambda: cfg("Qwen2Config", **_SMALL),
    "qwen2_window": lambda: cfg(
        "Qwen2Config", **_SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "gemma2": lambda: cfg("Gemma2Config", **_SMALL, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=1.0),
    "gemma3": lambda: cfg(
        "Gemma3TextConfig", **_SMALL, head_dim=8, sliding_window=WINDOW, layer_types=list(_ALTERNATING)
    ),
    "gpt_oss": lambda: cfg(
        "GptOssConfig", **_SMALL, head_dim=8, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2
    ),
    "phi3": lambda: cfg("Phi3Config", **_SMALL),
    "cohere2": lambda: cfg("Cohere2Config", **_SMALL, sliding_window=WINDOW, layer_types=list(_ALTERNATING)),
    "olmo2": lambda: cfg("Olmo2Config", **_SMALL),
}


#: encoders (bidirectional attention): name -> config, built with their masked-LM head
ENCODERS = {
    # dropout off: BERT's default 0.1 draws differ between one process and a split (not comparable)
    "bert": lambda: cfg(
        "BertConfig", **_SMALL, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    ),
    "modernbert": lambda: cfg(
        "ModernBertConfig", **_SMALL, local_attention=16, global_attn_every_n_layers=2, max_position_embeddings=64
    ),
}


def build(name: str, seed: int = 0) -> nn.Module:
    """The tiny causal LM (or masked LM, for :data:`ENCODERS`) ``name``, weights fixed by ``seed``."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    config = (DECODERS | ENCODERS)[name]()
    torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if name in ENCODERS else AutoModelForCausalLM
    model = auto.from_config(config)
    with torch.no_grad():  # attention sinks as trained ones differ per head (the init's ~0.02 would hide a mix-up)
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.copy_(torch.linspace(-1.0, 2.0, module.sinks.numel()))
    return model
