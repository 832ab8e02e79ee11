"""Tiny models for the sequence-split tests (context parallel all-gather / ring, Ulysses), at sequence
64 over the byte vocabulary of :class:`composable_atorch.data.TextDataset` (256): plain user models
calling scaled_dot_product_attention (:class:`UserLM` and two variants), a Llama, and the zoo of
transformers families.

Defaults left on (``use_cache`` too); sizes tiny: width 32, 4 heads, 2 key/value heads, 2 layers.
Sliding windows are 8 tokens (the families' 4096 would not matter at 64 tokens) and Gemma-2's logit
cap is 1.0 (its default 50 changes tiny logits by less than the tolerance), so a split that ignored
either would fail the comparison with one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.configs import cfg, llama_config, shape

VOCAB, WINDOW, SEQ = 256, 8, 64


def _attention_mlp(blk, x, q, k, v):
    """The rest of a pre-norm block once its heads ``q, k, v [b, heads, t, head_dim]`` are made: causal
    SDPA, the output projection, the MLP, both residuals."""
    b, t, _ = x.shape
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + blk.o(a.transpose(1, 2).reshape(b, t, -1))
    return x + blk.fc2(F.gelu(blk.fc1(blk.ln2(x))))


def _fused_heads(blk, x, heads):
    """q, k, v from one fused projection, ``heads`` of them."""
    b, t, _ = x.shape
    return blk.qkv(blk.ln1(x)).view(b, t, 3, heads, -1).permute(2, 0, 3, 1, 4)


class _LM(nn.Module):
    """Token and learned absolute position embeddings, a list of blocks (:meth:`block`, run by
    :meth:`run_block`), a norm and a head; ``forward(tokens, position_ids=None)``."""

    def __init__(self, vocab: int, d: int, layers: int, max_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(self.block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(tokens.size(1), device=tokens.device)[None]
        x = self.tok(tokens) + self.pos(position_ids)
        for blk in self.blocks:
            x = self.run_block(blk, x)
        return self.head(self.ln_f(x))


class UserLM(_LM):
    """A user's model: fused attention, its blocks ``nn.ModuleDict`` s (no block class)."""

    def __init__(self, vocab=VOCAB, d=32, heads=4, layers=2, max_len=SEQ):
        self.heads = heads  # before the blocks are built
        super().__init__(vocab, d, layers, max_len)

    def block(self, d: int) -> nn.Module:
        names = {"ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "o": nn.Linear(d, d)}
        return nn.ModuleDict(names | {"ln2": nn.LayerNorm(d), "fc1": nn.Linear(d, 2 * d), "fc2": nn.Linear(2 * d, d)})

    def run_block(self, blk, x):
        return _attention_mlp(blk, x, *_fused_heads(blk, x, self.heads))


class Block(nn.Module):
    """:class:`UserLM`'s block as a class of its own (what ``checkpoint(Block)`` names)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.o = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return _attention_mlp(self, x, *_fused_heads(self, x, self.heads))


class BlockLM(_LM):
    """:class:`UserLM` built of :class:`Block` s (the same weights for the same seed)."""

    def __init__(self, vocab=VOCAB, d=32, layers=2, max_len=SEQ):
        super().__init__(vocab, d, layers, max_len)

    def block(self, d: int) -> nn.Module:
        return Block(d)

    def run_block(self, blk, x):
        return blk(x)


class HeadsFromWidth(_LM):
    """A user's model written for tensor parallelism: separate q/k/v, heads read from the width
    (``view(b, t, -1, head_dim)``), so a rank holding half of the projections runs half of the heads."""

    def __init__(self, vocab=VOCAB, d=32, head_dim=8, layers=2, max_len=SEQ):
        self.head_dim = head_dim
        super().__init__(vocab, d, layers, max_len)

    def block(self, d: int) -> nn.Module:
        names = {"ln1": nn.LayerNorm(d), "q": nn.Linear(d, d), "k": nn.Linear(d, d), "v": nn.Linear(d, d)}
        names |= {"o": nn.Linear(d, d), "ln2": nn.LayerNorm(d)}
        return nn.ModuleDict(names | {"fc1": nn.Linear(d, 2 * d), "fc2": nn.Linear(2 * d, d)})

    def run_block(self, blk, x):
        b, t, _ = x.shape
        h = blk.ln1(x)
        q, k, v = (blk[n](h).view(b, t, -1, self.head_dim).transpose(1, 2) for n in "qkv")
        return _attention_mlp(blk, x, q, k, v)


def user_lm(seed: int = 0, **kw) -> UserLM:
    torch.manual_seed(seed)
    return UserLM(**kw)


def block_lm(seed: int = 0) -> BlockLM:
    torch.manual_seed(seed)
    return BlockLM()


def heads_from_width(seed: int = 0) -> HeadsFromWidth:
    torch.manual_seed(seed)
    return HeadsFromWidth()


def llama(seed: int = 0, heads: int = 4, kv_heads: int = 2, layers: int = 2, positions: int = SEQ):
    """A tiny transformers Llama (defaults left on) at this vocabulary and sequence."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = llama_config(
        vocab=VOCAB,
        layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
    )
    return LlamaForCausalLM(config)


def llama_mqa(seed: int = 0):
    """One key/value head: fewer than the sequence size, so Ulysses repeats them before its all-to-all."""
    return llama(seed, kv_heads=1)


def llama4(seed: int = 0):
    """Four decoder layers: two pipeline ranks x two stages each."""
    return llama(seed, layers=4)


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
