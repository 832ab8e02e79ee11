"""Models as users write them by hand, with no library conventions: the zoo's transformer and CNN,
the pipeline tests' residual-MLP chain and the tensor-parallel tests' ConvNeXt-style CNN.

Each is written differently on purpose (a norm before the head or not, an ``nn.ModuleList`` or an
``nn.Sequential``): transforms must find the blocks whatever the user called them.
"""

from __future__ import annotations

import torch
from torch import nn

from zoo.configs import VOCAB

#: classes of the zoo's image batches
CLASSES = 10


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
    """A plain user model: embedding, an ``nn.ModuleList`` of blocks (``block(d)``), a norm and a head."""

    def __init__(self, vocab: int = VOCAB, d: int = 64, layers: int = 2, block=UserBlock):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class ConvBlock(nn.Module):
    """A residual conv block as a user writes one (GroupNorm: no batch statistics between ranks)."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(4, c)

    def forward(self, x):
        return x + self.conv2(nn.functional.gelu(self.norm(self.conv1(x))))


class UserCNN(nn.Module):
    """A plain user CNN: a conv stem, residual conv blocks in an ``nn.ModuleList``, pooling, a head."""

    def __init__(self, c: int = 16, layers: int = 2, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(c) for _ in range(layers))
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=(2, 3)))


class Block(nn.Module):
    """A user's residual MLP block."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class UserNet(nn.Module):
    """A plain user model: embedding, a list of blocks, a head (no final norm)."""

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


class PointwiseBlock(nn.Module):
    """ConvNeXt's block as a user writes it: depthwise conv, then Linear(d, 4d) -> GELU -> Linear(4d, d)
    on channels-last activations, a residual around it."""

    def __init__(self, d: int):
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.norm(self.dw(x).permute(0, 2, 3, 1))
        return x + self.fc2(nn.functional.gelu(self.fc1(h))).permute(0, 3, 1, 2)


class PointwiseCNN(nn.Module):
    """A user's ConvNeXt-style CNN: a patchifying stem, pointwise blocks in an ``nn.Sequential``, a head."""

    def __init__(self, d: int = 16, labels: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, d, 4, stride=4)
        self.blocks = nn.Sequential(PointwiseBlock(d), PointwiseBlock(d))
        self.head = nn.Linear(d, labels)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))
