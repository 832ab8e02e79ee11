"""The one tiny-model builder and the one reference training loop every test shares.

``tiny_gpt`` builds the tiny GPT (seeded; sizes as keywords), ``train`` is the loop every plan
trains with (the plan optimizer's ``backward`` when it has one, ``composable_atorch.train_step``
for pipeline stages). ``_dp.py`` and ``matrix.py`` build on these; the older names (``gpt``,
``CFG``) stay. ``TokensDataset`` is the ATorch ports' dataset of seeded token rows.
"""

from __future__ import annotations

import copy

import torch
from torch.utils.data import DataLoader

import composable_atorch as ca
from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss

CFG = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=2)


def tiny_gpt(
    seed: int = 0,
    *,
    seq_len: int = CFG.seq_len,
    d_model: int = CFG.d_model,
    n_layer: int = CFG.n_layer,
    n_head: int = CFG.n_head,
) -> GPT:
    """The tests' tiny GPT, built after ``torch.manual_seed(seed)`` (same seed, same weights)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(seq_len=seq_len, d_model=d_model, n_layer=n_layer, n_head=n_head))


def gpt(seed: int = 0) -> GPT:
    return tiny_gpt(seed)


def text_loader(seq_len: int = CFG.seq_len, *, batch: int = 8, limit: int = 64, shuffle: bool = False) -> DataLoader:
    return DataLoader(TextDataset(seq_len, limit=limit), batch_size=batch, shuffle=shuffle)


def triple(model=None, *, batch=8, lr=1e-3, limit=64, optim_cls=torch.optim.AdamW):
    model = model if model is not None else gpt()
    optim = optim_cls(model.parameters(), lr=lr)
    return model, optim, text_loader(CFG.seq_len, batch=batch, limit=limit)


def twins():
    """Two identical (model, optim, loader) triples."""
    a = triple()
    m = copy.deepcopy(a[0])
    return a, triple(m)


def train(model, optim, loader, steps, *, use_optim_backward=True, on_grads=None, wrap=True):
    """The reference loop: ``steps`` optimizer steps (each ``optim.accumulation_steps`` micro-batches);
    returns per-micro-batch losses. The loss goes through ``optim.backward`` when the optimizer has
    one (``use_optim_backward=False`` forces a plain ``loss.backward()``); ``on_grads(model)`` runs
    between backward and step (clipping in a reference run, gradient checks). ``wrap=False`` raises
    StopIteration rather than start the loader again."""
    losses = []
    micro = getattr(optim, "accumulation_steps", 1)
    batches = _endless(loader) if wrap else iter(loader)
    while len(losses) < steps * micro:
        x, y = next(batches)
        if use_optim_backward and on_grads is None:
            losses.append(ca.train_step(model, optim, x, y, lm_loss))  # pipelines too
            continue
        loss = lm_loss(model(x), y)
        if use_optim_backward and hasattr(optim, "backward"):
            optim.backward(loss)
        else:
            loss.backward()
        if on_grads is not None:
            on_grads(model)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _endless(loader):
    while True:
        yield from loader


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class TokensDataset(torch.utils.data.Dataset):
    """Random token rows seeded by index, as {"source", "target"} with target == source (the ATorch
    ports' ``collate_sentences_lm`` input)."""

    def __init__(self, n, seq=32, vocab=128):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(1, self.vocab, (self.seq,), generator=g)
        return {"source": tokens, "target": tokens.clone()}
