"""Built-in models for demos, tests and benchmarks."""

from .gpt import GPT, Block, CausalSelfAttention, GPTConfig, MLP

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP"]
