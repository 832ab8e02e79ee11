"""Built-in models for demos, tests and benchmarks."""

from composable_atorch.models.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP"]
