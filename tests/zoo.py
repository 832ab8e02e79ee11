"""A zoo of tiny models as users bring them: Hugging Face architectures built from their configs
(no download) and a plain user-written ``nn.Module``, each with its batch and its loss.

    for name in ZOO:
        model = build(name)                  # seeded: the same weights on every call
        loss = zoo_loss(name, model, batch(name, seed=0))

``KIND[name]`` says what the architecture is (``"decoder"``: a causal LM; ``"encoder"``: masked LM;
``"seq2seq"``: encoder-decoder; ``"plain"``: the user model), which decides which transforms have a
meaning for it (a pipeline cut needs a decoder-only or plain chain model).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128
SEQ = 16

#: a small common shape: 2 layers, hidden 64, 4 heads (2 key/value heads where the family has GQA)
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def _cfg(cls_name: str, **fields):
    import transformers

    # the families' default special tokens lie outside the tiny vocabulary
    cfg = getattr(transformers, cls_name)(**{"bos_token_id": 1, "eos_token_id": 2, **fields})
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    return cfg


def _causal(cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(cfg)


CONFIGS = {
    "llama": lambda: _cfg("LlamaConfig", **_DECODER, num_key_value_heads=2),
    "mistral": lambda: _cfg("MistralConfig", **_DECODER, num_key_value_heads=2, sliding_window=None),
    "qwen2": lambda: _cfg("Qwen2Config", **_DECODER, num_key_value_heads=2),
    "qwen3": lambda: _cfg("Qwen3Config", **_DECODER, num_key_value_heads=2, head_dim=16),
    "gemma": lambda: _cfg("GemmaConfig", **_DECODER, num_key_value_heads=2, head_dim=16),
    "granite": lambda: _cfg("GraniteConfig", **_DECODER, num_key_value_heads=2),
    "olmo": lambda: _cfg("OlmoConfig", **_DECODER, num_key_value_heads=2),
    "stablelm": lambda: _cfg("StableLmConfig", **_DECODER, num_key_value_heads=2),
    "starcoder2": lambda: _cfg("Starcoder2Config", **_DECODER, num_key_value_heads=2),
    "phi": lambda: _cfg("PhiConfig", **_DECODER),
    "phi3": lambda: _cfg("Phi3Config", **_DECODER, num_key_value_heads=2, pad_token_id=0),
    "mixtral": lambda: _cfg(
        "MixtralConfig", **_DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    ),
    "gpt2": lambda: _cfg("GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "gpt_neox": lambda: _cfg(
        "GPTNeoXConfig", **_DECODER, max_position_embeddings=64, use_parallel_residual=True, rotary_pct=0.5
    ),
    "opt": lambda: _cfg(
        "OPTConfig",
        vocab_size=VOCAB,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=64,
    ),
    "bloom": lambda: _cfg("BloomConfig", vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
    "falcon": lambda: _cfg(
        "FalconConfig",
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        new_decoder_architecture=False,
        multi_query=True,
    ),
    "gptj": lambda: _cfg("GPTJConfig", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64),
    "bert": lambda: _cfg(
        "BertConfig",
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    ),
    "t5": lambda: _cfg(
        "T5Config",
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    ),
}

KIND = {name: "decoder" for name in CONFIGS}
KIND.update(bert="encoder", t5="seq2seq", user="plain")


class UserBlock(nn.Module):
    """A block as a user writes one: pre-norm attention (SDPA) and an MLP, no library conventions."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class UserModel(nn.Module):
    """A plain user model: embedding, an ``nn.ModuleList`` of blocks, a norm and a head."""

    def __init__(self, vocab: int = VOCAB, d: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(UserBlock(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


ZOO = (*CONFIGS, "user")


def build(name: str, seed: int = 0) -> nn.Module:
    """The tiny model ``name`` with weights fixed by ``seed`` (eager attention left to each family's default)."""
    torch.manual_seed(seed)
    if name == "user":
        return UserModel()
    cfg = CONFIGS[name]()
    if KIND[name] == "encoder":
        from transformers import BertForMaskedLM

        return BertForMaskedLM(cfg)
    if KIND[name] == "seq2seq":
        from transformers import T5ForConditionalGeneration

        return T5ForConditionalGeneration(cfg)
    return _causal(cfg)


def batch(name: str, seed: int = 0, size: int = 4) -> torch.Tensor:
    """A global batch of token ids (the same on every rank for the same seed)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(1, VOCAB, (size, SEQ), generator=g)


def zoo_loss(name: str, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The family's training loss on ``ids`` (labels are the inputs: a language-model objective)."""
    if name == "user":
        logits = model(ids)
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    out = model(input_ids=ids, labels=ids)
    return out.loss
