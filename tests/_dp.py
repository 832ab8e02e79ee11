"""Helpers for the data-parallel tests: one tiny GPT, fixed global batches, a training loop.

Every run starts from the same seed and sees the same global batches, so a world-2 run can be
compared with one process (``reference``) and sharded runs with ddp.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader

import composable_atorch as ca
from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss

SEQ, BATCH, STEPS = 16, 8, 5


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=SEQ, d_model=16, n_layer=2, n_head=2))


def loader(batch: int = BATCH, shuffle: bool = False) -> DataLoader:
    return DataLoader(TextDataset(SEQ, limit=64), batch_size=batch, shuffle=shuffle)


def full_params(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by the user's names, gathered whole (DTensor shards -> full tensors)."""
    out = {}
    for name, p in ca.runtime.optim.named_parameters(m).items():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def train(m, optim, data, steps: int = STEPS, *, on_grads=None) -> list[float]:
    """The one loop every plan trains with; ``steps`` optimizer steps (micro-batches as needed)."""
    losses, micro = [], getattr(optim, "accumulation_steps", 1)
    it = iter(data)
    for _ in range(steps * micro):
        x, y = next(it)
        loss = lm_loss(m(x), y)
        if hasattr(optim, "backward"):
            optim.backward(loss)
        else:
            loss.backward()
        if on_grads is not None:
            on_grads(m)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def reference(steps: int = STEPS, lr: float = 1e-3, clip: float | None = None):
    """One process, no plan, the same global batches: what data parallelism must reproduce."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    losses = []
    for _, (x, y) in zip(range(steps), loader()):
        loss = lm_loss(m(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return full_params(m), losses


def run_plan(*transforms, steps: int = STEPS, lr: float = 1e-3, batch: int = BATCH):
    """Apply ``compose(*transforms)`` to a fresh model/AdamW/loader and train; return what tests compare."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    plan = ca.compose(*transforms)
    m, opt, data = plan(m, opt, loader(batch))
    losses = train(m, opt, data, steps)
    return {"params": full_params(m), "losses": losses, "finite": all(map(math.isfinite, losses)), "explain": plan.explain(), "plan": plan, "model": m, "optim": opt, "loader": data}


def plain(value):
    """Tensors -> numpy arrays, recursively: results cross the process boundary by value
    (torch's shared-memory tensor passing breaks when the sending rank has already exited)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return value


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((torch.as_tensor(a[k]).float() - torch.as_tensor(b[k]).float()).abs().max()) for k in a)


def bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
