"""The built-in corpus: the documentation text CPython ships in ``pydoc_data.topics``.

About 465 KB of English prose and code that every machine with Python has, so the demo needs no
download and the repository copies no third-party text. Tokens are bytes (vocabulary 256).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from composable_atorch.errors import ConfigError


def corpus_text() -> str:
    """The corpus as one string, topics in sorted order (stable across runs)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class TextDataset(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes -> ``(inputs, targets)`` shifted by one.

    ``split="train"`` takes the first 90% of the corpus, ``"val"`` the rest.
    """

    def __init__(self, seq_len: int = 64, split: str = "train", *, limit: int | None = None):
        if split not in ("train", "val"):
            raise ConfigError("TextDataset.split", split, "'train' or 'val'")
        tokens = ByteTokenizer().encode(corpus_text())
        cut = int(len(tokens) * 0.9)
        tokens = tokens[:cut] if split == "train" else tokens[cut:]
        n = (len(tokens) - 1) // seq_len
        if limit is not None:
            n = min(n, limit)
        self.seq_len = seq_len
        self.tokens = tokens[: n * seq_len + 1]
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        chunk = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]
