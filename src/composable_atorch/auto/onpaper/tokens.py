"""A language-model workload made of shapes only, for planning on paper: ``global_batch`` sequences of
``seq`` token ids on the meta device (nothing is allocated; the estimate reads shapes), next-token
cross-entropy on the model's logits, AdamW.

    workload = token_workload(lambda: AutoModelForCausalLM.from_config(config), seq=8192, global_batch=512)
    search(workload, on_paper=True, env=Environment(world_size=64, nodes=8, device="cuda", hardware="h100-sxm"))

Batches are ``(inputs, targets)``, with ``criterion``: pipeline plans run the loss inside their schedule,
and context parallelism splits both tensors along the sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from composable_atorch.auto.workload import Workload
from composable_atorch.errors import ConfigError
from composable_atorch.models.gpt import lm_loss as next_token_loss


@dataclass(frozen=True)
class TokenShapes(torch.utils.data.Dataset):
    """``samples`` pairs of ``seq`` int64 token ids on the meta device: a batch's shapes, no data."""

    seq: int
    samples: int

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int):
        tokens = torch.empty(self.seq, dtype=torch.long, device="meta")
        return tokens, tokens


def logits_of(output):
    """A model's logits: an HF output's ``.logits``, or the tensor a plain model returns."""
    return getattr(output, "logits", output)


def lm_criterion(output, targets) -> torch.Tensor:
    """Next-token cross-entropy on the logits (the targets are the inputs shifted by the loader)."""
    return next_token_loss(logits_of(output), targets)


def lm_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    inputs, targets = batch
    return lm_criterion(model(inputs), targets)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def token_workload(model_fn: Callable[[], torch.nn.Module], *, seq: int, global_batch: int) -> Workload:
    """The workload of ``global_batch`` sequences of ``seq`` tokens for ``model_fn`` (built on meta)."""
    for name, value in (("seq", seq), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, value, "an integer >= 1")
    return Workload(model_fn, adamw, TokenShapes(seq, global_batch), lm_loss, global_batch, criterion=lm_criterion)
