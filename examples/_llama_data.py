"""Shared by the Llama examples: the model and corpus tokens, token windows as HF batches, and the loss
(importable, so picklable for the search's worker processes)."""

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
    """ATorch's ``loss_func(input, output)``: a HF causal LM computes its loss from ``labels``."""
    return output.loss


def llama_and_tokens(model_path: str | None, seq_len: int):
    """``(model, tokens)``: a pretrained Llama and its tokenizer's ids of the corpus, or (no path) a tiny
    Llama built from a config on byte tokens — nothing downloaded."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from composable_atorch.data.text import ByteTokenizer, corpus_text

    torch.manual_seed(0)
    if model_path:
        from transformers import AutoTokenizer

        tokens = torch.tensor(AutoTokenizer.from_pretrained(model_path)(corpus_text())["input_ids"])
        return AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32), tokens
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq_len,
    )
    return LlamaForCausalLM(config), ByteTokenizer().encode(corpus_text())
