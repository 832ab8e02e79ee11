"""A tiny GPT (byte-level), small enough for CPU tests and demos, shaped like the real thing.

Attention is written out (matmul, causal mask, softmax) on purpose: it is what ``module_replace``
swaps for fused scaled-dot-product attention, so the swap has something real to do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} must be divisible by n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.o = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # head size from the projection's output, not from d_model: under tensor parallelism each
        # rank's q/k/v hold n_head / degree heads of the same size (and any attention twin inherits this)
        b, t, _ = x.shape
        return tuple(proj(x).view(b, t, self.n_head, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))

    def attend(self, q, k, v):
        t = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = F.dropout(scores.softmax(dim=-1), self.dropout, self.training)
        return weights @ v

    def forward(self, x):
        b, t, _ = x.shape
        y = self.attend(*self.heads(x))
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``GPT(cfg)(tokens) -> logits``; tokens ``(batch, seq)`` int64, logits ``(batch, seq, vocab)``."""

    def __init__(self, cfg: GPTConfig | None = None, **overrides):
        super().__init__()
        cfg = cfg or GPTConfig(**overrides)
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens, position_ids=None):
        """``position_ids``: the tokens' global positions (a sequence split gives each rank's part its
        own); None: ``0 .. seq-1``."""
        t = tokens.size(1)
        if position_ids is None:
            position_ids = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------
# Fused twins of the attention, registered as module_replace pairs (models sit above transforms,
# so the model declares its own replacements; transforms never import models).
# ---------------------------------------------------------------------------------------------


class SDPACausalSelfAttention(CausalSelfAttention):
    """The built-in GPT attention through torch's fused scaled-dot-product attention."""

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)


class FlashCausalSelfAttention(CausalSelfAttention):
    """The built-in GPT attention through flash-attn's kernel (CUDA, fp16/bf16 only)."""

    def attend(self, q, k, v):
        from flash_attn import flash_attn_func

        # flash-attn takes (batch, seq, heads, head_dim); the model keeps (batch, heads, seq, head_dim)
        out = flash_attn_func(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            dropout_p=self.dropout if self.training else 0.0,
            causal=True,
        )
        return out.transpose(1, 2)


def _register_attention_pairs() -> None:
    from composable_atorch.transforms.modules import FLASH_ATTN, HALF_DTYPES, register_replace_pair

    # for one source the first usable pair wins: flash before sdpa
    register_replace_pair(
        "gpt_flash_attn",
        CausalSelfAttention,
        FlashCausalSelfAttention,
        supported_dtypes=HALF_DTYPES,
        requires=(FLASH_ATTN,),
    )
    register_replace_pair("gpt_sdpa", CausalSelfAttention, SDPACausalSelfAttention)


_register_attention_pairs()
