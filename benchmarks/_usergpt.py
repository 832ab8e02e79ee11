"""A user's own GPT-like model (not the library's): 4 blocks, d 256, sequence 128, SDPA attention.

Module-level builders only, so trial workers and torchrun scripts can import them. ``small=True``
(benchmarks' ``--small``) is the same model at 2 blocks, d 128, sequence 64, for runs in minutes."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, HEADS, LAYERS, SEQ, GLOBAL_BATCH, SAMPLES = 4096, 256, 4, 4, 128, 16, 512


class Block(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class UserGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = LAYERS, seq: int = SEQ):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.size(1), device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def model_fn() -> nn.Module:
    return UserGPT()


def optim_fn(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def criterion(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def loss_fn(model, batch):
    tokens, targets = batch
    return criterion(model(tokens), targets)


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences with next-token targets (same data for every plan and for Accelerate)."""

    def __init__(self, n: int = SAMPLES, seq: int = SEQ, vocab: int = VOCAB, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


#: the ``--small`` variant's sizes (the global batch stays GLOBAL_BATCH)
SMALL = {"dim": 128, "layers": 2, "seq": 64}


def builders(small: bool = False):
    """``(model_fn, dataset)`` of the default or the small variant (picklable: trial workers get them)."""
    if not small:
        return model_fn, Tokens()
    return functools.partial(UserGPT, **SMALL), Tokens(seq=SMALL["seq"])


def workload(small: bool = False):
    """The benchmark's Workload: the user's factories, data, loss and criterion, global batch GLOBAL_BATCH."""
    from composable_atorch.auto import Workload

    model, data = builders(small)
    return Workload(model, optim_fn, data, loss_fn, GLOBAL_BATCH, criterion=criterion)
