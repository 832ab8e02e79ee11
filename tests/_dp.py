"""The data-parallel suite: the shared tiny GPT and loop (helpers.py) at its sizes, compared with one
process (tests/equivalence.py) on the same global batches, and sharded runs with ddp."""

from __future__ import annotations

import itertools
import math

import torch
from torch.utils.data import DataLoader

import composable_atorch as ca
import equivalence as eq
from composable_atorch.models.gpt import lm_loss

from helpers import text_loader, tiny_gpt
from helpers import train as shared_train

SEQ, BATCH, STEPS = 16, 8, 5


def model() -> torch.nn.Module:
    return tiny_gpt(0, seq_len=SEQ, d_model=16)


def loader(batch: int = BATCH, shuffle: bool = False) -> DataLoader:
    return text_loader(SEQ, batch=batch, limit=64, shuffle=shuffle)


def train(m, optim, data, steps: int = STEPS, *, on_grads=None) -> list[float]:
    """The one loop every plan trains with (helpers.train); ``steps`` optimizer steps."""
    return shared_train(m, optim, data, steps, on_grads=on_grads, wrap=False)


def reference(steps: int = STEPS, lr: float = 1e-3, clip: float | None = None):
    """One process, no plan, the same global batches: what data parallelism must reproduce."""
    m = model()
    clip_fn = None if clip is None else (lambda mod: torch.nn.utils.clip_grad_norm_(mod.parameters(), clip))
    batches = itertools.islice(loader(), steps)
    return eq.reference(m, torch.optim.AdamW(m.parameters(), lr=lr), batches, lm_loss, on_grads=clip_fn)


def run_plan(*transforms, steps: int = STEPS, lr: float = 1e-3, batch: int = BATCH):
    """Apply ``compose(*transforms)`` to a fresh model/AdamW/loader and train; return what tests compare."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    plan = ca.compose(*transforms)
    applied = plan(m, opt, loader(batch))
    m, opt, data = applied
    losses = train(m, opt, data, steps)
    explain = plan.explain(applied=applied)
    return {
        "params": eq.full_params(m),
        "losses": losses,
        "finite": all(map(math.isfinite, losses)),
        "explain": explain,
        "plan": plan,
        "model": m,
        "optim": opt,
        "loader": data,
    }
