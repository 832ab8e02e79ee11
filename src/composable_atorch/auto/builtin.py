"""The built-in workload: the tiny GPT on the built-in corpus, as picklable factories.

Used by the demo, the CLI's default task, the benchmark and the tests. A frozen dataclass whose
bound methods pickle by reference, so trials in fresh processes rebuild exactly the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from composable_atorch.auto.workload import Workload
from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss


@dataclass(frozen=True)
class GPTTask:
    seq_len: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    lr: float = 3e-3
    batch_size: int = 16
    #: windows of the corpus to use (None: all of it)
    limit: int | None = None

    def model(self) -> GPT:
        return GPT(GPTConfig(seq_len=self.seq_len, d_model=self.d_model, n_layer=self.n_layer, n_head=self.n_head))

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.01)

    def dataset(self) -> TextDataset:
        return TextDataset(self.seq_len, limit=self.limit)

    @staticmethod
    def loss(model: torch.nn.Module, batch) -> torch.Tensor:
        tokens, targets = batch
        return lm_loss(model(tokens), targets)

    def workload(self, seed: int = 0) -> Workload:
        # criterion: the same loss on (output, targets), so pipeline plans train too (see Workload)
        return Workload(
            self.model, self.optimizer, self.dataset(), GPTTask.loss, self.batch_size, seed=seed, criterion=lm_loss
        )
