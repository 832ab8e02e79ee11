"""Small builders shared by the core tests: a tiny GPT, its optimizer and loader, a train loop."""

from __future__ import annotations

import copy

import torch
from torch.utils.data import DataLoader

from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss

CFG = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=2)


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def triple(model=None, *, batch=8, lr=1e-3, limit=64, optim_cls=torch.optim.AdamW):
    model = model if model is not None else gpt()
    optim = optim_cls(model.parameters(), lr=lr)
    loader = DataLoader(TextDataset(CFG.seq_len, limit=limit), batch_size=batch)
    return model, optim, loader


def twins():
    """Two identical (model, optim, loader) triples."""
    a = triple()
    m = copy.deepcopy(a[0])
    return a, triple(m)


def train(model, optim, loader, steps, *, use_optim_backward=True):
    """Run ``steps`` optimizer steps (each maybe several micro-batches); return per-micro-batch losses."""
    losses = []
    micro = getattr(optim, "accumulation_steps", 1)
    while len(losses) < steps * micro:
        for x, y in loader:
            if len(losses) >= steps * micro:
                break
            loss = lm_loss(model(x), y)
            if use_optim_backward:
                optim.backward(loss)
            else:
                loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    return losses


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}
