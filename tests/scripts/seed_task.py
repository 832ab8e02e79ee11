"""Seed-style inputs for the auto_accelerate tests: dict batches, unpack_dict, loss_func(input, output).

Importable (not __main__) so trial workers spawned during the search can rebuild it.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss


class SeedGPT(GPT):
    """The built-in GPT taking the seed's keyword batch: ``model(**{"tokens": ..., "targets": ...})``."""

    def __init__(self):
        super().__init__(GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=2))

    def forward(self, tokens, targets=None):
        return super().forward(tokens)


class DictText(Dataset):
    def __init__(self, limit: int = 128):
        self.inner = TextDataset(32, limit=limit)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        x, y = self.inner[i]
        return {"tokens": x, "targets": y}


def loss_func(data, output):
    return lm_loss(output, data["targets"])


def build():
    torch.manual_seed(0)
    return SeedGPT()


def broken_loss_func(data, output):
    """A loss that fails inside the worker: the dry run must report it, not crash the caller."""
    raise RuntimeError("injected loss failure")
