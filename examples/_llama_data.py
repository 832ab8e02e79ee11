"""Shared by the Llama examples: token windows as HF batches, and the loss (importable, so picklable
for the search's worker processes)."""

from __future__ import annotations

import torch


class Windows(torch.utils.data.Dataset):
    """Non-overlapping token windows as the dicts a HF causal LM takes (labels = inputs)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, n: int):
        self.tokens, self.seq_len, self.n = tokens, seq_len, min(n, len(tokens) // seq_len)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = self.tokens[i * self.seq_len : (i + 1) * self.seq_len]
        return {"input_ids": ids, "labels": ids}


def causal_lm_loss(data, output):
    """The seed's ``loss_func(input, output)``: a HF causal LM computes its loss from ``labels``."""
    return output.loss
